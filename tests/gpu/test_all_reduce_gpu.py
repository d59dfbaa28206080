"""Symmetric-memory all-reduce on two GPUs (``replaylm.model.allreduce``), through the
benchmark that times it (``benchmarks/allreduce.py``): its sums equal NCCL's on random bf16
tensors (two ranks: one rounding of the same two values), eagerly and replayed from a captured
graph, and the engine's ``auto`` plan is measured and decided on every bucket."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.allreduce import parse_args, run  # noqa: E402
from replaylm.model.allreduce import MEASURED_TOKENS, NCCL, ONE_SHOT, TWO_SHOT  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]


def test_symm_mem_sums_equal_nccl_eager_and_in_graphs_and_auto_decides_every_bucket():
    record = run(parse_args(["--gpus", "2", "--hidden", "64,4096", "--tokens", "1,3,8,256,512",
                             "--calls", "4", "--trials", "2"]))
    assert record["symm_mem_unavailable"] is None, record["symm_mem_unavailable"]
    assert len(record["rows"]) == 10
    for row in record["rows"]:
        assert row[f"{ONE_SHOT}_max_diff"] == 0.0, row
        assert row[f"{TWO_SHOT}_max_diff"] == 0.0, row
        assert all(row[f"{a}_us"] > 0 for a in (NCCL, ONE_SHOT, TWO_SHOT)), row
        if row["tokens"] > max(MEASURED_TOKENS):
            assert row["engine"] == NCCL  # above the symmetric buffer
    for report in record["engine"].values():
        assert report["setting"] == "auto" and report["reason"].startswith("measured")
        assert set(report["choice"]) == {str(t) for t in MEASURED_TOKENS}
        for times in report["latency_us"].values():
            assert set(times) == {NCCL, ONE_SHOT, TWO_SHOT} and min(times.values()) > 0
