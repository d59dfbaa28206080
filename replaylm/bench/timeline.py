"""One engine step as a timeline: its kernels (or host ops) on a time axis, and the gaps
between them.

The profiler's traced run marks every ``EngineCore.step`` call with a ``replaylm.step`` range
(:class:`StepMarks`). :func:`step_spans` collects what one step ran:

- on a GPU, the device spans (kernels, copies, memsets) whose launch happened inside the
  step's range, matched through the trace's correlation ids (a graph replay's kernels carry
  the id of their ``cudaGraphLaunch``);
- on a CPU, where nothing runs on a device, the outermost operators the host ran inside the
  step (the gaps between them are the host's own time between operators).

:func:`busy_and_gaps` is the arithmetic: the union of the spans is busy time, whatever the
window holds outside it is gap; ``gap share`` = gap time ÷ window.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
from typing import Any

from replaylm.bench.observer import StepObserver

STEP_MARK = "replaylm.step"
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")


@dataclasses.dataclass(frozen=True)
class Span:
    """One kernel or operator: name, start and end in µs."""

    name: str
    start: float
    end: float


@dataclasses.dataclass
class Timeline:
    """One step: spans relative to the window's start (µs), the gaps, and their share."""

    label: str
    source: str  # "device" (GPU kernels) or "host" (CPU operators)
    window_us: float
    busy_us: float
    gaps: list[tuple[float, float]]
    spans: list[Span]

    @property
    def gap_us(self) -> float:
        return self.window_us - self.busy_us

    @property
    def gap_share(self) -> float:
        return self.gap_us / self.window_us if self.window_us > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"label": self.label, "source": self.source, "window_us": round(self.window_us, 3),
                "busy_us": round(self.busy_us, 3), "gap_us": round(self.gap_us, 3),
                "gap_share": round(self.gap_share, 4), "kernels": len(self.spans),
                "gaps": [[round(a, 3), round(b, 3)] for a, b in self.gaps],
                "spans": [[s.name, round(s.start, 3), round(s.end, 3)] for s in self.spans]}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Timeline:
        """The inverse of :meth:`as_dict` (for drawing from a JSON file)."""
        return Timeline(d["label"], d["source"], d["window_us"], d["busy_us"],
                        [tuple(g) for g in d["gaps"]],
                        [Span(n, a, b) for n, a, b in d["spans"]])


def busy_and_gaps(spans: list[Span], window: tuple[float, float] | None = None
                  ) -> tuple[float, list[tuple[float, float]]]:
    """Busy time (the union of ``spans``, clipped to ``window``) and the uncovered intervals
    of ``window``, in order. ``window`` defaults to first start .. last end."""
    if not spans:
        return 0.0, [window] if window and window[1] > window[0] else []
    lo = min(s.start for s in spans) if window is None else window[0]
    hi = max(s.end for s in spans) if window is None else window[1]
    busy, gaps, covered = 0.0, [], lo
    for s in sorted(spans, key=lambda s: s.start):
        start, end = max(s.start, lo), min(s.end, hi)
        if end <= covered or end <= start:
            continue
        if start > covered:
            gaps.append((covered, start))
        busy += end - max(start, covered)
        covered = end
    if covered < hi:
        gaps.append((covered, hi))
    return busy, gaps


def make_timeline(label: str, source: str, spans: list[Span]) -> Timeline:
    """Spans shifted so the first starts at 0, with busy time and gaps over first..last."""
    if not spans:
        return Timeline(label, source, 0.0, 0.0, [], [])
    t0 = min(s.start for s in spans)
    rel = sorted((Span(s.name, s.start - t0, s.end - t0) for s in spans), key=lambda s: s.start)
    busy, gaps = busy_and_gaps(rel)
    return Timeline(label, source, max(s.end for s in rel), busy, gaps, rel)


def _outermost(events: list[dict[str, Any]]) -> list[Span]:
    """Operators not nested inside another (one host thread: ranges nest or follow)."""
    out: list[Span] = []
    end = float("-inf")
    for e in sorted(events, key=lambda e: (float(e["ts"]), -float(e.get("dur", 0.0)))):
        start = float(e["ts"])
        if start >= end:
            out.append(Span(str(e.get("name", "?")), start, start + float(e.get("dur", 0.0))))
            end = out[-1].end
    return out


def step_spans(events: list[dict[str, Any]]) -> list[list[Span]]:
    """The spans of every marked step of a Chrome trace, in step order."""
    # Host ranges only: CUDA traces mirror each range on the GPU's timeline as a
    # ``gpu_user_annotation``, which must not split the host's steps.
    marks = sorted((e for e in events if e.get("name") == STEP_MARK and e.get("ph") == "X"
                    and e.get("cat") == "user_annotation"), key=lambda e: float(e["ts"]))
    ranges = [(float(m["ts"]), float(m["ts"]) + float(m.get("dur", 0.0)), m.get("tid"))
              for m in marks]
    device = [e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS]
    starts = [a for a, _, _ in ranges]
    steps: list[list[Span]] = [[] for _ in ranges]

    def step_of(ts: float) -> int | None:
        i = bisect.bisect_right(starts, ts) - 1
        return i if i >= 0 and ts <= ranges[i][1] else None

    if device:
        launch_at = {(e.get("args") or {}).get("correlation"): float(e["ts"]) for e in events
                     if e.get("ph") == "X" and e.get("cat") in LAUNCH_CATS}
        for e in device:
            ts = launch_at.get((e.get("args") or {}).get("correlation"))
            i = step_of(ts) if ts is not None else None
            if i is not None:
                steps[i].append(Span(str(e.get("name", "?")), float(e["ts"]),
                                     float(e["ts"]) + float(e.get("dur", 0.0))))
        return steps
    for i, (a, b, tid) in enumerate(ranges):
        inside = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"
                  and e.get("tid") == tid and a <= float(e["ts"]) <= b]
        steps[i] = _outermost(inside)
    return steps


def steady_step(steps: list[list[Span]]) -> int | None:
    """A representative decode step: the middle of the steps after the first (the prefill)
    that ran something."""
    candidates = [i for i, s in enumerate(steps) if s and i > 0] or \
        [i for i, s in enumerate(steps) if s]
    return candidates[len(candidates) // 2] if candidates else None


def trace_timeline(trace_path: str, label: str) -> Timeline | None:
    """The timeline of a steady decode step of a trace written by the profiler."""
    with open(trace_path) as f:
        events = json.load(f).get("traceEvents", [])
    steps = step_spans(events)
    i = steady_step(steps)
    if i is None:
        return None
    source = "device" if any(e.get("cat") in DEVICE_CATS for e in events) else "host"
    return make_timeline(label, source, steps[i])


class StepMarks(StepObserver):
    """Wraps every ``EngineCore.step`` in a ``replaylm.step`` profiler range, so a trace shows
    where each step begins and ends on the host."""

    def __init__(self) -> None:
        self._range: Any = None

    def begin(self) -> None:
        from torch.profiler import record_function

        self._range = record_function(STEP_MARK)
        self._range.__enter__()

    def end(self, launched: bool) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
