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

from bisect import bisect_left
from collections.abc import Sequence

import numpy as np

#: Up to this many candidate draft tokens the chooser runs in plain Python: numpy's fixed
#: cost per call (some twenty calls) is most of a choice at batch 1.
SMALL = 64


def choose_budget(tier_costs: Sequence[tuple[int, float]], base_tokens: int,
                  alphas: Sequence[float], max_drafts: Sequence[int],
                  base_cost: float | None = None, margin: float = 0.0,
                  base_rate: float | None = None) -> list[int]:
    """Draft tokens per request maximising expected emitted tokens per second.

    ``base_tokens``: the step's tokens without drafts (one per decoding request plus prefill
    chunks); ``alphas[i]``: request ``i``'s acceptance estimate; ``max_drafts[i]``: the most
    drafts it has (drafter, ``num_speculative_tokens``, length limits). ``tier_costs`` are
    the costs of steps that verify drafts; ``base_cost``, when known, is what a step
    without drafts costs (plain decoding, which overlaps the host's work with the GPU's),
    else the staircase's cost of ``base_tokens``. Drafts are chosen only where their
    expected tokens per second beat plain decoding's (``base_rate``, or else
    ``len(alphas) / base_cost``) by more than the share ``margin``.
    """
    n = len(alphas)
    tier_list = [t for t, _ in tier_costs]
    i = bisect_left(tier_list, base_tokens)
    if i == len(tier_list) or not n:
        return [0] * n
    if base_cost is None:
        base_cost = tier_costs[i][1]
    if base_rate is None:
        base_rate = n / base_cost
    if sum(m for a, m in zip(alphas, max_drafts) if a > 0) <= SMALL:
        return _choose_small(tier_list, [c for _, c in tier_costs], base_tokens, alphas,
                             max_drafts, base_rate, margin)
    tiers = np.array(tier_list)
    costs = np.array([c for _, c in tier_costs])
    # Every request's marginal gains alpha**j (j = 1 .. its most drafts), best first (ties:
    # the lower request index); the first D of them are the best use of D draft tokens.
    most = np.array([m if a > 0 else 0 for a, m in zip(alphas, max_drafts)], dtype=np.int64)
    owner = np.repeat(np.arange(n), most)
    power = np.arange(owner.size) - np.repeat(np.cumsum(most) - most, most) + 1
    gains = np.asarray(alphas, dtype=np.float64)[owner] ** power
    order = np.lexsort((owner, -gains))[:int(tiers[-1]) - base_tokens]  # the top tier holds
    if not order.size:
        return [0] * n
    d = np.arange(1, order.size + 1)
    rates = (n + np.cumsum(gains[order])) / costs[np.searchsorted(tiers, base_tokens + d)]
    best = int(np.argmax(rates))  # the first of equal rates: the fewest drafts
    if rates[best] <= base_rate * (1 + max(margin, 1e-9)):
        return [0] * n
    return np.bincount(owner[order[:best + 1]], minlength=n).tolist()


def _choose_small(tiers: list[int], costs: list[float], base_tokens: int,
                  alphas: Sequence[float], max_drafts: Sequence[int], base_rate: float,
                  margin: float) -> list[int]:
    """``choose_budget`` for few candidate drafts, in plain Python: the same gains, the same
    order (best first, ties to the lower request index) and the same choice."""
    n = len(alphas)
    gains = [(a ** j, i) for i, (a, m) in enumerate(zip(alphas, max_drafts)) if a > 0
             for j in range(1, m + 1)]
    gains.sort(key=lambda g: -g[0])  # stable: equal gains keep the lower index first
    del gains[tiers[-1] - base_tokens:]  # the top tier holds
    best, best_rate, cum = -1, 0.0, 0.0
    for d, (gain, _) in enumerate(gains, start=1):
        cum += gain
        rate = (n + cum) / costs[bisect_left(tiers, base_tokens + d)]
        if rate > best_rate:
            best, best_rate = d, rate
    if best < 0 or best_rate <= base_rate * (1 + max(margin, 1e-9)):
        return [0] * n
    ks = [0] * n
    for _, i in gains[:best]:
        ks[i] += 1
    return ks
