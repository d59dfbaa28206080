"""The ranks' statistics summed into one engine's (``MultiProcessEngine.stats`` and
``graph_stats``)."""

from __future__ import annotations

import dataclasses

from replaylm.engine.stats import EngineStats
from replaylm.speculative.stats import SpecStats


def summed_stats(per_rank: list[EngineStats], graph_mode: str, rejected: int) -> EngineStats:
    """The ranks' engine counters summed (gauges too: running, waiting, KV blocks), with
    ``rejected`` requests the driver refused before any rank saw them."""
    total = EngineStats(graph_mode=graph_mode)
    for f in dataclasses.fields(EngineStats):
        values = [getattr(s, f.name) for s in per_rank]
        if isinstance(values[0], int | float | dict) and not isinstance(values[0], bool):
            setattr(total, f.name, _sum(values))
    total.last_step = per_rank[0].last_step
    total.requests_rejected += rejected
    total.spec = SpecStats.summed([s.spec for s in per_rank if s.spec is not None])
    return total


def summed_graphs(per_rank: list[dict]) -> dict:
    """The ranks' graph statistics summed, and each rank's under ``ranks``."""
    total = _sum(per_rank)
    padded = total["padded_tokens"]
    total["padding_share"] = round(1 - total["real_tokens"] / padded, 4) if padded else 0.0
    for key in ("nodes", "tail_nodes", "streams", "forks"):  # per graph: every rank the same
        total[key] = per_rank[0][key]
    if "all_reduce" in per_rank[0]:  # rank 0's group's plan (each group's under ranks)
        total["all_reduce"] = per_rank[0]["all_reduce"]
    total["ranks"] = per_rank
    return total


def _sum(values: list):
    """Numbers summed; dicts summed key by key (recursively); anything else: the first."""
    first = values[0]
    if isinstance(first, dict):
        keys = {k: None for v in values for k in v}
        return {k: _sum([v[k] for v in values if k in v]) for k in keys}
    if isinstance(first, int | float) and not isinstance(first, bool):
        return sum(values)
    return first
