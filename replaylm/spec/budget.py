"""The draft budget: how many draft tokens each request verifies this step.

A step of ``T`` tokens costs what its token tier costs (graphs pad ``T`` up to the tier:
a staircase). A request whose next draft token is accepted with probability ``alpha``
emits, with ``k`` drafts, ``1 + alpha + ... + alpha**k`` tokens in expectation, so its
``j``-th draft token adds ``alpha**j``. For a total of ``D`` draft tokens the best split
takes the ``D`` largest of those marginal gains (they fall with ``j``); the chooser sweeps
``D`` and keeps the one with the most expected tokens per second. ``D = 0`` is plain
decoding, and a larger ``D`` must do strictly better to be chosen.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left
from collections.abc import Sequence


def step_cost(tier_costs: Sequence[tuple[int, float]], num_tokens: int) -> float | None:
    """Seconds of a step of ``num_tokens`` tokens: the cost of the smallest tier holding it
    (``tier_costs`` sorted by tier); None above the top tier."""
    i = bisect_left([t for t, _ in tier_costs], num_tokens)
    return tier_costs[i][1] if i < len(tier_costs) else None


def choose_budget(tier_costs: Sequence[tuple[int, float]], base_tokens: int,
                  alphas: Sequence[float], max_drafts: Sequence[int],
                  base_cost: float | None = None) -> list[int]:
    """Draft tokens per request maximising expected emitted tokens per second.

    ``base_tokens``: the step's tokens without drafts (one per decoding request plus prefill
    chunks); ``alphas[i]``: request ``i``'s acceptance estimate; ``max_drafts[i]``: the most
    drafts it has (drafter, ``num_speculative_tokens``, length limits). ``tier_costs`` are
    the costs of steps that verify drafts; ``base_cost``, when known, is what a step
    without drafts costs (plain decoding, which overlaps the host's work with the GPU's),
    else the staircase's cost of ``base_tokens``.
    """
    tiers = [t for t, _ in tier_costs]
    costs = [c for _, c in tier_costs]
    k = [0] * len(alphas)
    i = bisect_left(tiers, base_tokens)
    if i == len(tiers) or not alphas:
        return k
    if base_cost is None:
        base_cost = costs[i]
    # Max-heap of each request's next marginal gain.
    heap = [(-a, r, 1) for r, a in enumerate(alphas) if max_drafts[r] > 0 and a > 0]
    heapq.heapify(heap)
    gained, best_rate, best_d, taken = 0.0, len(alphas) / base_cost, 0, []
    d = 0
    while heap:
        neg, r, j = heapq.heappop(heap)
        gained -= neg
        d += 1
        taken.append(r)
        if j < max_drafts[r]:
            heapq.heappush(heap, (neg * alphas[r], r, j + 1))
        while tiers[i] < base_tokens + d:  # the tier holding this many tokens
            i += 1
            if i == len(tiers):
                break
        if i == len(tiers):
            break
        rate = (len(alphas) + gained) / costs[i]
        if rate > best_rate * (1 + 1e-9):
            best_rate, best_d = rate, d
    for r in taken[:best_d]:
        k[r] += 1
    return k
