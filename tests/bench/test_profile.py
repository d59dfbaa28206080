"""The profiler's trace reading (``replaylm.bench.profile``), on synthetic traces."""

from __future__ import annotations

import json

import torch

from replaylm.bench.profile import chain_share, kernel_busy_share, top_kernels
from replaylm.kernels import launch_bytes


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


def test_chain_share_charges_each_kernel_what_it_adds_past_the_ones_before(tmp_path):
    # A PDL chain: b starts inside a and ends 5 after it; c lies inside b (adds nothing);
    # d follows a gap (the gap is idle, not charged). Shares sum to the busy time.
    path = _trace(tmp_path, [("a", 0, 10), ("b", 4, 11), ("c", 6, 3), ("d", 30, 5),
                             ("b", 33, 4)])
    shares = chain_share(path, tokens=1)
    assert shares == [("a", 10.0, 1.0, None), ("b", 7.0, 2.0, None), ("d", 5.0, 1.0, None),
                      ("c", 0.0, 1.0, None)]
    assert sum(us for _, us, _, _ in shares) == 10 + 5 + 5 + 2


def test_chain_share_keeps_launch_shapes_apart(tmp_path):
    events = [{"ph": "X", "cat": "kernel", "name": "k", "ts": ts, "dur": 5,
               "args": {"grid": grid}} for ts, grid in ((0, [4, 1, 1]), (10, [8, 1, 1]))]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    assert chain_share(str(path), tokens=1) == [("k [4, 1, 1]", 5.0, 1.0, None),
                                                ("k [8, 1, 1]", 5.0, 1.0, None)]


def test_chain_share_gives_the_bandwidth_of_recorded_launch_shapes(tmp_path, monkeypatch):
    """A projection's launches record their bytes (``kernels.launch_bytes``); the share
    then carries bytes over the time they add. An unrecorded shape, or one recorded with
    two byte counts, has none."""
    monkeypatch.setattr(launch_bytes, "BYTES", {})
    launch_bytes.record("proj", (4,), 8_000_000)
    launch_bytes.record("twice", (2,), 100)
    launch_bytes.record("twice", (2,), 200)
    # proj twice, 4 µs each, the second partly overlapped (adds 3): 16 MB in 7 µs.
    events = [{"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur,
               "args": {"grid": grid}}
              for name, ts, dur, grid in (("proj", 0, 4, [4, 1, 1]), ("proj", 3, 4, [4, 1, 1]),
                                          ("twice", 10, 2, [2, 1, 1]), ("other", 20, 1, [1, 1, 1]))]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    shares = chain_share(str(path), tokens=1)
    assert shares[0] == ("proj [4, 1, 1]", 7.0, 2.0, round(16e6 / 7 / 1e3, 1))
    assert {k: gbs for k, _, _, gbs in shares[1:]} == {"twice [2, 1, 1]": None,
                                                        "other [1, 1, 1]": None}
    assert launch_bytes.lookup("proj", [4, 1, 1]) == 8_000_000
    assert launch_bytes.moved(torch.zeros(2, 3), None, torch.zeros(4, dtype=torch.int8)) == 28
