"""The profiler's trace reading (``replaylm.bench.profile``), on synthetic traces."""

from __future__ import annotations

import json

from replaylm.bench.profile import kernel_busy_share, top_kernels


def _trace(tmp_path, spans):
    events = [{"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}
              for name, ts, dur in spans]
    events.append({"ph": "X", "cat": "cpu_op", "name": "host", "ts": 0, "dur": 1000})
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    return str(path)


def test_kernel_busy_share_merges_overlaps_and_ends_at_the_last_end(tmp_path):
    # Busy 0-10, then 20-120 (b, with c inside it): the window ends when b ends (120), not
    # when the last kernel to start (c) does (60).
    path = _trace(tmp_path, [("a", 0, 10), ("b", 20, 100), ("c", 50, 10)])
    assert kernel_busy_share(path) == round(110 / 120, 4)
    assert top_kernels(path, tokens=2) == [("b", 50.0, 0.5), ("a", 5.0, 0.5), ("c", 5.0, 0.5)]
