"""``benchmarks/allreduce.py``'s report (the measuring part needs two GPUs:
tests/gpu/test_all_reduce_gpu.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import benchmarks.allreduce as bench  # noqa: E402

RECORD = {
    "gpus": 2, "device": "GPU", "torch": "x", "dtype": "bfloat16", "calls": 4, "trials": 2,
    "symm_mem_unavailable": None,
    "engine": {"64": {"summary": "one_shot up to 8 tokens, nccl above", "reason": "measured"}},
    "rows": [{"hidden": 64, "tokens": t, "bytes": 128 * t, "engine": e, "nccl_us": 9.0,
              "one_shot_us": 4.0, "two_shot_us": 5.5, "one_shot_max_diff": 0.0,
              "two_shot_max_diff": d, "fastest": "one_shot"}
             for t, e, d in ((1, "one_shot", 0.0), (512, "nccl", 0.5))],
}


def test_the_report_prints_a_row_per_message_and_flags_differing_sums(monkeypatch, capsys,
                                                                     tmp_path):
    monkeypatch.setattr(bench, "run", lambda ns: RECORD)
    out = tmp_path / "r.json"
    assert bench.main(["--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "hidden | tokens | KiB | nccl us | one_shot us | two_shot us | fastest | engine" in text
    assert "64 | 512 | 64.0 | 9.00 | 4.00 | 5.50 | one_shot | nccl" in text
    assert "engine auto, hidden 64: one_shot up to 8 tokens, nccl above" in text
    assert "differ from NCCL's: {'two_shot_max_diff': 0.5}" in text
    assert json.loads(out.read_text()) == RECORD
