"""The step timeline's busy/gap arithmetic and step extraction, on synthetic traces."""

from __future__ import annotations

import json

import pytest

from replaylm.bench.timeline import (
    STEP_MARK,
    Span,
    Timeline,
    busy_and_gaps,
    make_timeline,
    steady_step,
    step_spans,
    trace_timeline,
)


def test_busy_and_gaps_merges_overlaps_and_lists_the_holes():
    # a 0-10, b 4-15 (overlaps a), c 6-9 (inside b), d 30-35: busy 15 + 5, gap 15-30.
    spans = [Span("a", 0, 10), Span("b", 4, 15), Span("c", 6, 9), Span("d", 30, 35)]
    busy, gaps = busy_and_gaps(spans)
    assert busy == 20
    assert gaps == [(15, 30)]


def test_busy_and_gaps_clips_to_a_window():
    spans = [Span("a", -5, 5), Span("b", 8, 12), Span("late", 50, 60)]
    busy, gaps = busy_and_gaps(spans, window=(0, 20))
    assert busy == 5 + 4
    assert gaps == [(5, 8), (12, 20)]
    assert busy_and_gaps([], window=(0, 3)) == (0.0, [(0, 3)])


def test_timeline_shifts_to_zero_and_reports_the_gap_share():
    t = make_timeline("eager", "device", [Span("k1", 100, 110), Span("k2", 130, 140)])
    assert [(s.start, s.end) for s in t.spans] == [(0, 10), (30, 40)]
    assert t.window_us == 40 and t.busy_us == 20 and t.gaps == [(10, 30)]
    assert t.gap_share == pytest.approx(0.5)
    again = Timeline.from_dict(json.loads(json.dumps(t.as_dict())))
    assert again.gap_share == pytest.approx(0.5) and again.spans == t.spans


def _mark(ts, dur, tid=1):
    return {"ph": "X", "cat": "user_annotation", "name": STEP_MARK, "ts": ts, "dur": dur,
            "tid": tid}


def test_device_spans_belong_to_the_step_that_launched_them():
    # Step 0 (host 0-100) launches kernels 1 and 2; step 1 (host 100-200) launches a graph
    # (correlation 3) whose two kernels share its id. Kernels run later than their launches.
    events = [_mark(0, 100), _mark(100, 100)]
    # The GPU-side mirrors of the step ranges (CUDA traces have them) are not steps.
    events += [dict(_mark(ts, 30), cat="gpu_user_annotation") for ts in (115, 205)]
    launches = [(1, 10, "cudaLaunchKernel"), (2, 20, "cuLaunchKernelEx"), (3, 150, "cudaGraphLaunch")]
    for corr, ts, name in launches:
        cat = "cuda_runtime" if name.startswith("cuda") else "cuda_driver"
        events.append({"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": 2,
                       "args": {"correlation": corr}})
    kernels = [(1, "k1", 120, 10), (2, "k2", 135, 5), (3, "g1", 210, 4), (3, "g2", 215, 4)]
    for corr, name, ts, dur in kernels:
        events.append({"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur,
                       "args": {"correlation": corr}})
    steps = step_spans(events)
    assert [[s.name for s in step] for step in steps] == [["k1", "k2"], ["g1", "g2"]]
    assert steady_step(steps) == 1
    t = make_timeline("x", "device", steps[0])
    assert t.window_us == 20 and t.busy_us == 15 and t.gaps == [(10, 15)]


def test_host_ops_keep_the_outermost_per_step(tmp_path):
    # Without device spans the timeline is the host's outermost operators in the step.
    events = [_mark(0, 50), _mark(60, 50)]
    ops = [("aten::linear", 65, 20, 1), ("aten::addmm", 66, 18, 1),  # nested: dropped
           ("aten::add", 90, 5, 1), ("other-thread", 70, 5, 2), ("before", 5, 3, 1)]
    for name, ts, dur, tid in ops:
        events.append({"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "tid": tid})
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    t = trace_timeline(str(path), "eager")
    assert t is not None and t.source == "host"
    assert [s.name for s in t.spans] == ["aten::linear", "aten::add"]
    assert t.window_us == 30 and t.busy_us == 25 and t.gap_share == pytest.approx(5 / 30)
