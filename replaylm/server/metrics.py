"""Prometheus metrics (``GET /metrics``), all prefixed ``replaylm_``.

Engine counters are read from the engine's ``stats`` at scrape time (a collector, so the
engine never calls into Prometheus; a data-parallel driver sums its ranks' then); latencies and finish reasons are observed by the engine loop as
deltas go out. Each server gets its own registry, so several apps in one process (tests) never
collide.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Latency buckets span a tiny CPU model (sub-ms tokens) to a loaded GPU server (seconds).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class _EngineStatsCollector(Collector):
    """Exports ``EngineStats`` as read at scrape time (plain attribute reads: no lock needed)."""

    def __init__(self, stats: Callable[[], Any], in_flight: Callable[[], int]) -> None:
        self.stats = stats
        self.in_flight = in_flight

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        counters = {
            "requests_added": ("requests accepted by the engine", s.requests_added),
            "requests_rejected": ("requests the engine refused as invalid", s.requests_rejected),
            "requests_aborted": ("requests aborted (disconnects, shutdown)", s.requests_aborted),
            "requests_failed": ("requests that failed alone (finish reason error)",
                                s.requests_failed),
            "prompt_tokens": ("prompt tokens of accepted requests", s.prompt_tokens),
            "generation_tokens": ("tokens generated", s.generated_tokens),
            "preemptions": ("requests preempted for lack of KV blocks", s.preemptions),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(f"replaylm_{name}", doc, value=value)
        steps = CounterMetricFamily("replaylm_steps", "engine steps by graph mode",
                                    labels=["mode"])
        for mode, n in dict(s.steps_by_mode).items():  # dict() copies atomically under the GIL
            steps.add_metric([mode], n)
        yield steps
        yield from _graph_metrics(getattr(s, "graphs", None))
        yield from _spec_metrics(getattr(s, "spec", None))
        mode = GaugeMetricFamily("replaylm_graph_mode", "configured graph mode (value 1)",
                                 labels=["mode"])
        mode.add_metric([str(s.graph_mode)], 1)
        yield mode
        gauges = {
            "num_requests_running": ("requests running in the engine", s.running),
            "num_requests_waiting": ("requests waiting in the engine", s.waiting),
            "num_requests_in_flight": ("requests the server holds (queued or streaming)",
                                       self.in_flight()),
            "kv_cache_usage_ratio": ("share of KV blocks in use", s.kv_usage),
            "kv_blocks_used": ("KV blocks in use", s.kv_blocks_used),
            "kv_blocks_total": ("KV blocks requests can use", s.kv_blocks_total),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"replaylm_{name}", doc, value=value)


def _graph_metrics(g: Any) -> Iterator[Metric]:
    """The graph runtime's counters (``GraphStats``); absent parts export as zero/empty."""
    hits = CounterMetricFamily("replaylm_graph_tier_hits", "steps by graph mode and tier",
                               labels=["mode", "tier"])
    fallbacks = CounterMetricFamily("replaylm_graph_fallbacks",
                                    "steps that could not replay a graph, by reason",
                                    labels=["reason"])
    real = getattr(g, "real_tokens", 0)
    padded = getattr(g, "padded_tokens", 0)
    for key, n in dict(getattr(g, "hits", None) or {}).items():
        mode, _, tier = str(key).partition(":")  # GraphStats keys hits as "mode:tier"
        hits.add_metric([mode, tier or "none"], n)
    for reason, n in dict(getattr(g, "fallbacks", None) or {}).items():
        fallbacks.add_metric([str(reason)], n)
    yield hits
    yield fallbacks
    yield CounterMetricFamily("replaylm_graph_real_tokens",
                              "real tokens run by graph replays", value=real)
    yield CounterMetricFamily("replaylm_padding_tokens",
                              "padding tokens added to fill graph tiers", value=max(0, padded - real))
    yield GaugeMetricFamily("replaylm_cuda_graphs", "CUDA graphs captured",
                            value=getattr(g, "num_graphs", 0))


def _spec_metrics(sp: Any) -> Iterator[Metric]:
    """Speculative decoding's counters (``speculative.stats.SpecStats``); none when it is off."""
    if sp is None:
        return
    d = sp.as_dict()
    for name, doc in (("verify_steps", "steps in which some request verified drafts"),
                      ("draft_tokens", "draft tokens verified"),
                      ("accepted_tokens", "draft tokens accepted")):
        yield CounterMetricFamily(f"replaylm_spec_{name}", doc, value=d[name])
    for name, doc in (("mean_accepted_length", "accepted drafts per request per verify"),
                      ("acceptance_rate", "share of verified drafts accepted"),
                      ("draft_tokens_per_step", "draft tokens per verify step"),
                      ("verify_tokens_per_step", "tokens per verify step"),
                      ("padded_waste", "padded share of verify steps' tokens"),
                      ("budget_tokens_per_step", "draft tokens the budget allows per step"),
                      ("draft_ms_per_step", "milliseconds the drafter takes per step"),
                      ("draft_forwards_per_step", "draft model steps per engine step")):
        yield GaugeMetricFamily(f"replaylm_spec_{name}", doc, value=d[name])


class ServerMetrics:
    """Per-server registry; implements the engine loop's ``LoopMetrics`` hooks."""

    def __init__(self, stats: Callable[[], Any], in_flight: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineStatsCollector(stats, in_flight))
        self._finished = Counter("replaylm_requests_finished", "requests finished, by reason",
                                 ["finish_reason"], registry=self.registry)
        self._rejected = Counter("replaylm_http_errors", "HTTP requests refused, by status",
                                 ["status"], registry=self.registry)
        self._ttft = Histogram("replaylm_time_to_first_token_seconds",
                               "time from arrival to the first output token",
                               buckets=_TTFT_BUCKETS, registry=self.registry)
        self._tpot = Histogram("replaylm_time_per_output_token_seconds",
                               "time between output tokens", buckets=_TPOT_BUCKETS,
                               registry=self.registry)
        self._e2e = Histogram("replaylm_e2e_request_latency_seconds",
                              "time from arrival to the last token", buckets=_E2E_BUCKETS,
                              registry=self.registry)
        for reason in ("stop", "length", "abort", "error"):
            self._finished.labels(reason)  # present at 0, so rates work from the first scrape
        self._admin = Counter("replaylm_admin_actions", "admin actions done (server.admin)",
                              ["action"], registry=self.registry)
        self._admin_s = Counter("replaylm_admin_seconds", "seconds admin actions took, "
                                "draining included", ["action"], registry=self.registry)
        for action in ("update_weights", "sleep", "wake_up"):
            self._admin.labels(action)
            self._admin_s.labels(action)

    def admin(self, action: str, seconds: float) -> None:
        self._admin.labels(action).inc()
        self._admin_s.labels(action).inc(seconds)

    def first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def output_tokens(self, seconds_per_token: float, n: int) -> None:
        for _ in range(n):
            self._tpot.observe(seconds_per_token)

    def finished(self, reason: str, e2e_seconds: float) -> None:
        self._finished.labels(reason).inc()
        self._e2e.observe(e2e_seconds)

    def http_error(self, status: int) -> None:
        self._rejected.labels(str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
