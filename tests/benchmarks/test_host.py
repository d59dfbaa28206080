"""``benchmarks/host.py``: the host-path benchmark runs a decode phase on the CPU."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.host import host_step_ms  # noqa: E402


def test_host_bench_times_each_decode_step() -> None:
    times, gc_ms = host_step_ms(requests=4, steps=6, prompt_len=8)
    # The prefill step (the first token) is not timed; the other 5 tokens take 5 decode steps,
    # and with overlap scheduling one more step takes the last samples.
    assert 5 <= len(times) <= 6 and all(t > 0 for t in times) and gc_ms >= 0


def test_host_bench_closed_loop_replaces_finished_requests() -> None:
    one, _ = host_step_ms(requests=4, steps=6, prompt_len=8)
    two, _ = host_step_ms(requests=4, steps=6, prompt_len=8, waves=2)
    # The second wave's 4 requests run after the first's finish: at least 6 steps more.
    assert len(two) >= len(one) + 6


def test_host_bench_runs_a_real_model() -> None:
    """``model``: the named model runs for real (here the built-in one on the CPU)."""
    times, _ = host_step_ms(requests=2, steps=4, prompt_len=8, model="default")
    assert 3 <= len(times) <= 4 and all(t > 0 for t in times)


def test_host_bench_runs_verify_steps() -> None:
    """``spec_k``: every draft accepted at acceptance 1, so 12 tokens take a prefill and
    about three verify steps of 3 drafts + 1; pipelined, the two cohorts take a step each."""
    plain, _ = host_step_ms(requests=4, steps=12, prompt_len=8)
    spec, _ = host_step_ms(requests=4, steps=12, prompt_len=8, spec_k=3, acceptance=1.0)
    piped, _ = host_step_ms(requests=4, steps=12, prompt_len=8, spec_k=3, acceptance=1.0,
                            pipeline="on")
    assert len(spec) <= 4 < len(plain)
    assert len(spec) < len(piped) <= 2 * len(spec) + 2
