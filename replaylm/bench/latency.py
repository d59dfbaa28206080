"""Serving metrics of one ``bench serve`` run, with the definitions vLLM's and SGLang's
serving benchmarks use:

- TTFT: from sending a request to its first token (first streamed chunk with text);
- TPOT (time per output token): ``(end-to-end - TTFT) / (output tokens - 1)`` per request;
- ITL (inter-token latency): the time between consecutive chunks of a request, all requests
  pooled;
- end-to-end latency: from sending a request to its last chunk;
- throughput: completed requests, output tokens and all tokens per second of the run (from
  the first send to the last finish);
- goodput: completed requests per second that met every SLO given (TTFT, TPOT, end-to-end).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from replaylm.bench.common import percentile

PCTS = (50, 90, 99)


@dataclasses.dataclass
class RequestResult:
    """What the client saw of one request; times in seconds from the run's start."""

    index: int
    prompt_len: int | None
    output_len: int  # asked for
    sent_s: float
    chunk_s: list[float] = dataclasses.field(default_factory=list)
    output_tokens: int = 0
    finished_s: float | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.finished_s is not None and bool(self.chunk_s)

    @property
    def ttft_ms(self) -> float:
        return (self.chunk_s[0] - self.sent_s) * 1e3

    @property
    def e2e_ms(self) -> float:
        return ((self.finished_s or self.sent_s) - self.sent_s) * 1e3

    @property
    def tpot_ms(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e_ms - self.ttft_ms) / (self.output_tokens - 1)

    @property
    def itl_ms(self) -> list[float]:
        return [(b - a) * 1e3 for a, b in zip(self.chunk_s, self.chunk_s[1:])]

    def as_dict(self) -> dict[str, Any]:
        d = {"index": self.index, "prompt_len": self.prompt_len, "output_len": self.output_len,
             "output_tokens": self.output_tokens, "sent_s": round(self.sent_s, 6),
             "error": self.error}
        if self.ok:
            d |= {"ttft_ms": round(self.ttft_ms, 3), "e2e_ms": round(self.e2e_ms, 3),
                  "tpot_ms": None if self.tpot_ms is None else round(self.tpot_ms, 3)}
        return d


def distribution(values: list[float]) -> dict[str, float | None]:
    """Mean and p50/p90/p99 (ms)."""
    mean = round(sum(values) / len(values), 4) if values else None
    return {"mean": mean, **{f"p{q}": percentile(values, q) for q in PCTS}}


def meets_slo(r: RequestResult, slo: dict[str, float]) -> bool:
    """Completed, and within every bound given (a one-token request has no TPOT)."""
    if not r.ok:
        return False
    if "ttft_ms" in slo and r.ttft_ms > slo["ttft_ms"]:
        return False
    if "tpot_ms" in slo and r.tpot_ms is not None and r.tpot_ms > slo["tpot_ms"]:
        return False
    return not ("e2e_ms" in slo and r.e2e_ms > slo["e2e_ms"])


def summarize(results: list[RequestResult], slo: dict[str, float]) -> dict[str, Any]:
    """The run's metrics (see the module docstring); ``slo`` maps ``ttft_ms``, ``tpot_ms``,
    ``e2e_ms`` to bounds (an empty SLO counts every completed request)."""
    done = [r for r in results if r.ok]
    end = max((r.finished_s for r in done), default=0.0) or 0.0
    start = min((r.sent_s for r in results), default=0.0)
    duration = max(end - start, 1e-9)
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_len or 0 for r in done)
    good = sum(meets_slo(r, slo) for r in done)
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            key = (r.error or "no output")[:120]
            errors[key] = errors.get(key, 0) + 1
    return {
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": errors,
        "duration_s": round(duration, 4),
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "request_throughput": round(len(done) / duration, 4),
        "output_throughput": round(out_tokens / duration, 4),
        "total_token_throughput": round((in_tokens + out_tokens) / duration, 4),
        "ttft_ms": distribution([r.ttft_ms for r in done]),
        "tpot_ms": distribution([t for r in done if (t := r.tpot_ms) is not None]),
        "itl_ms": distribution([x for r in done for x in r.itl_ms]),
        "e2e_ms": distribution([r.e2e_ms for r in done]),
        "goodput": {"slo": dict(slo), "requests": good, "req_s": round(good / duration, 4),
                    "share": round(good / len(results), 4) if results else 0.0},
    }


def format_runs(runs: list[dict[str, Any]]) -> str:
    """One line per (mode, rate): throughput, goodput and p50/p99 latencies."""
    head = (f"{'mode':<19} {'rate':>6} {'done':>5} {'req/s':>7} {'out tok/s':>10} "
            f"{'goodput':>8} {'TTFT p50/p99 ms':>17} {'TPOT p50/p99':>14} "
            f"{'ITL p50/p99':>14} {'E2E p99 ms':>11}")
    lines = [head, "-" * len(head)]

    def pair(d: dict[str, Any]) -> str:
        if d["p50"] is None:
            return "-"
        return f"{d['p50']:.1f}/{d['p99']:.1f}"

    for r in runs:
        e2e = "-" if r["e2e_ms"]["p99"] is None else f"{r['e2e_ms']['p99']:.1f}"
        lines.append(
            f"{r['mode']:<19} {r['rate_label']:>6} {r['completed']:>5} "
            f"{r['request_throughput']:>7.2f} {r['output_throughput']:>10.1f} "
            f"{r['goodput']['req_s']:>8.2f} {pair(r['ttft_ms']):>17} {pair(r['tpot_ms']):>14} "
            f"{pair(r['itl_ms']):>14} {e2e:>11}")
    return "\n".join(lines)
