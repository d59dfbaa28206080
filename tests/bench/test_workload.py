"""``bench serve``'s workload (lengths, arrivals, traces) and metrics, on made-up data."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from replaylm.bench.latency import RequestResult, meets_slo, summarize
from replaylm.bench.workload import (
    fit_context,
    load_trace,
    parse_rates,
    poisson_arrivals,
    sample_lengths,
    synthetic,
    with_arrivals,
)


def test_parse_rates_accepts_inf_and_rejects_nonpositive():
    assert parse_rates("1, 2.5,inf") == [1.0, 2.5, math.inf]
    for bad in ("0", "-1", "", "fast"):
        with pytest.raises(ValueError):
            parse_rates(bad)


def test_poisson_arrivals_are_seeded_and_have_the_rate():
    a = poisson_arrivals(4000, 8.0, np.random.default_rng(1))
    assert a == poisson_arrivals(4000, 8.0, np.random.default_rng(1))
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:]))
    assert 4000 / a[-1] == pytest.approx(8.0, rel=0.05)
    assert poisson_arrivals(3, math.inf, np.random.default_rng(1)) == [0.0, 0.0, 0.0]


def test_length_distributions():
    rng = np.random.default_rng(0)
    assert sample_lengths(3, 7, "fixed", 0.5, rng) == [7, 7, 7]
    uni = sample_lengths(2000, 100, "uniform", 0.5, rng)
    assert min(uni) >= 50 and max(uni) <= 150 and np.mean(uni) == pytest.approx(100, rel=0.03)
    exp = sample_lengths(4000, 50, "exponential", 0.5, rng)
    assert min(exp) >= 1 and np.mean(exp) == pytest.approx(50, rel=0.06)
    with pytest.raises(ValueError, match="unknown length distribution"):
        sample_lengths(1, 5, "zipf", 0.5, rng)


def test_synthetic_runs_share_lengths_not_prompts():
    a = synthetic(20, 16, 8, "uniform", 0.5, 1000, seed=3, prompt_seed=10)
    b = synthetic(20, 16, 8, "uniform", 0.5, 1000, seed=3, prompt_seed=11)
    assert [(s.prompt_len, s.output_len) for s in a] == [(s.prompt_len, s.output_len) for s in b]
    assert all(len(s.prompt) == s.prompt_len for s in a)
    assert all(x.prompt != y.prompt for x, y in zip(a, b))
    timed = with_arrivals(a, 5.0, seed=0)
    assert [s.prompt for s in timed] == [s.prompt for s in a] and timed[-1].arrival_s > 0


def test_load_trace_reads_prompts_lengths_and_times(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(d) for d in [
        {"arrival_s": 2.5, "prompt": "hello there", "output_len": 4},
        {"arrival_s": 1.5, "prompt_len": 6, "output_len": 3},
        {"arrival_s": 2.0, "prompt": [5, 6, 7], "output_len": 2},
    ]) + "\n")
    specs = load_trace(path, vocab_size=50, seed=0)
    assert [s.arrival_s for s in specs] == [0.0, 0.5, 1.0]
    assert [s.prompt_len for s in specs] == [6, 3, None]
    assert specs[1].prompt == [5, 6, 7] and specs[2].prompt == "hello there"
    assert all(0 <= t < 50 for t in specs[0].prompt)
    path.write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError, match=r"t.jsonl:1: needs output_len"):
        load_trace(path, 50, 0)


def test_fit_context_shortens_what_does_not_fit():
    specs = synthetic(2, 10, 10, "fixed", 0.5, 100, seed=0)
    fitted, clipped = fit_context(specs, 16)
    assert clipped == 2 and [(s.prompt_len, s.output_len) for s in fitted] == [(10, 6)] * 2
    fitted, clipped = fit_context(synthetic(1, 30, 5, "fixed", 0.5, 100, seed=0), 16)
    assert clipped == 1 and (fitted[0].prompt_len, len(fitted[0].prompt), fitted[0].output_len) \
        == (15, 15, 1)


def _result(i, sent, chunks, tokens, prompt=10):
    return RequestResult(i, prompt, tokens, sent, chunks, tokens, chunks[-1] if chunks else None)


def test_summarize_latencies_throughput_and_goodput():
    # Request 0: sent 0, tokens at 0.1, 0.2, 0.4 -> TTFT 100, E2E 400, TPOT 150, ITL 100, 200.
    # Request 1: sent 1, tokens at 1.3, 1.4 -> TTFT 300, E2E 400, TPOT 100, ITL 100.
    # Request 2 failed.
    results = [_result(0, 0.0, [0.1, 0.2, 0.4], 3), _result(1, 1.0, [1.3, 1.4], 2),
               RequestResult(2, 10, 5, 0.5, error="HTTP 503")]
    s = summarize(results, {"ttft_ms": 200.0})
    assert s["completed"] == 2 and s["failed"] == 1 and s["errors"] == {"HTTP 503": 1}
    assert s["duration_s"] == pytest.approx(1.4)
    assert s["output_throughput"] == pytest.approx(5 / 1.4, abs=1e-3)
    assert s["total_token_throughput"] == pytest.approx(25 / 1.4, abs=1e-3)
    assert s["ttft_ms"]["p50"] == pytest.approx(200) and s["ttft_ms"]["mean"] == pytest.approx(200)
    assert s["tpot_ms"]["mean"] == pytest.approx(125)
    assert s["itl_ms"]["p50"] == pytest.approx(100) and s["itl_ms"]["p99"] == pytest.approx(198, abs=0.01)
    assert s["e2e_ms"]["p90"] == pytest.approx(400)
    assert s["goodput"]["requests"] == 1 and s["goodput"]["share"] == pytest.approx(1 / 3, abs=1e-3)
    assert summarize(results, {})["goodput"]["requests"] == 2


def test_meets_slo_checks_every_bound():
    r = _result(0, 0.0, [0.05, 0.15, 0.35], 3)  # TTFT 50, TPOT 150, E2E 350
    assert meets_slo(r, {"ttft_ms": 60, "tpot_ms": 150, "e2e_ms": 350})
    assert not meets_slo(r, {"tpot_ms": 149})
    assert not meets_slo(r, {"e2e_ms": 300})
    assert meets_slo(_result(1, 0.0, [0.5], 1), {"tpot_ms": 1})  # one token: no TPOT
