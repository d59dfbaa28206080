"""``benchmarks/host.py``: the host-path benchmark runs a decode phase on the CPU."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.host import host_step_ms  # noqa: E402


def test_host_bench_runs_the_decode_phase() -> None:
    assert host_step_ms(requests=4, steps=6, prompt_len=8) > 0
