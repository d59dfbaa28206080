"""The batched rows of ``bench decode`` (``bench.steady``): N requests at a time in a closed
loop, repeats with their spread, per-step samples and the attribution of the slowest steps."""

from __future__ import annotations

import pytest

from replaylm import LLM
from replaylm.bench.decode import bench_batched
from replaylm.bench.observer import StepSample
from replaylm.bench.steady import requests_for, spread, tail_attribution


def sample(ms, prefill=0, decode=8, gc_ms=0.0, host_ms=0.1):
    return StepSample(ms=ms, host_ms=host_ms, wait_ms=ms - host_ms, gc_ms=gc_ms,
                      prefill_tokens=prefill, decode_tokens=decode)


def test_requests_cover_min_seconds_in_whole_waves():
    # 4 ms steps, 256 new tokens: a wave of decodes takes 1.024 s; 5 s need 5 waves.
    assert requests_for(5.0, 4.0, 256, 256) == 5 * 256
    assert requests_for(0.0, 4.0, 64, 256) == 64  # at least one wave
    assert requests_for(1.0, 1.0, 8, 100) == 8 * 10


def test_spread_reports_median_quartiles_and_relative_range():
    s = spread([100.0, 90.0, 110.0, 95.0, 105.0])
    assert s["median"] == 100.0 and s["min"] == 90.0 and s["max"] == 110.0
    assert s["q1"] == 95.0 and s["q3"] == 105.0
    assert s["spread"] == pytest.approx(0.2)


def test_tail_attribution_names_prefill_gc_and_host():
    base = [sample(4.0) for _ in range(96)]
    slow = [sample(20.0, prefill=8192, decode=64),  # a prefill step
            sample(15.0),                            # the step after it (overlap: its wait)
            sample(18.0, gc_ms=13.0),                # a garbage collection
            sample(12.0, host_ms=11.0)]              # host-bound
    samples = base[:10] + slow[:2] + base[10:50] + slow[2:3] + base[50:] + slow[3:]
    tail = tail_attribution(samples, share=0.04)
    assert tail["steps"] == 4 and tail["threshold_ms"] == 12.0
    assert (tail["prefill"], tail["gc"], tail["host"], tail["other"]) == (2, 1, 1, 0)
    assert tail["prefill_steps"] == 1 and tail["mixed_steps"] == 1
    assert tail["decode_only_p50_ms"] == 4.0
    assert tail["gc_ms_total"] == 13.0


def test_batched_row_runs_n_at_a_time_for_every_request():
    llm = LLM("default", max_num_seqs=8, num_kv_blocks=64, max_model_len=128,
              max_mixed_prefill_tokens=8)
    row = bench_batched(llm, 2, prompt_len=6, new_tokens=3, repeats=3, requests=5)
    assert row.requests == 5 and len(row.all_tok_s) == 3 and len(row.all_wall_s) == 3
    assert row.generated_tokens == 5 * 3
    assert row.tok_s == row.tok_s_spread["median"]
    steps = row.steps
    assert all(s["decode_tokens"] <= 2 for s in steps)  # never more than 2 requests at once
    assert sum(s["prefill_tokens"] for s in steps) == 5 * 6
    assert sum(s["decode_tokens"] for s in steps) == 5 * 2  # the 1st token comes with prefill
    assert row.step_ms_p50 <= row.step_ms_p99 and row.tail["steps"] >= 1
    assert llm.engine.block_manager.num_used_blocks == 0
