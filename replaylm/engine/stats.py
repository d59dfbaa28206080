"""The engine's counters, in one object (logged, returned by ``LLM.stats()``, exported)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class StepRecord:
    mode: str
    tier: int | None
    real_tokens: int
    padded_tokens: int
    num_reqs: int
    fallback_reason: str | None = None
    prefill_tokens: int = 0  # of real_tokens: prompt chunks; the rest decode


@dataclass
class EngineStats:
    requests_added: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    requests_failed: int = 0  # finished with "error": a failure of that request alone
    requests_rejected: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    preemptions: int = 0
    running: int = 0
    waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    graph_mode: str = "eager"
    steps_by_mode: dict[str, int] = field(default_factory=dict)
    last_step: StepRecord | None = None
    # Prefix caching: prompt (+ recomputed output) tokens looked up at admission, and how many
    # of them were served from cached blocks; cached blocks include unheld (evictable) ones.
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    kv_blocks_cached: int = 0
    prefix_cache_evictions: int = 0
    graphs: object | None = None  # the graph runtime's GraphStats (hits, padding, capture)
    spec: object | None = None  # speculative decoding's SpecStats (None: speculation off)

    def record_step(self, rec: StepRecord) -> None:
        self.steps += 1
        self.steps_by_mode[rec.mode] = self.steps_by_mode.get(rec.mode, 0) + 1
        self.last_step = rec

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / max(1, self.kv_blocks_total)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hit_tokens / max(1, self.prefix_cache_queried_tokens)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["kv_usage"] = round(self.kv_usage, 4)
        d["prefix_cache_hit_rate"] = round(self.prefix_cache_hit_rate, 4)
        if self.graphs is not None:
            d["graphs"] = self.graphs.as_dict()
        if self.spec is not None:
            d["spec"] = self.spec.as_dict()
        return d
