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

from collections.abc import Sequence

import numpy as np


def choose_budget(tier_costs: Sequence[tuple[int, float]], base_tokens: int,
                  alphas: Sequence[float], max_drafts: Sequence[int],
                  base_cost: float | None = None, margin: float = 0.0) -> list[int]:
    """Draft tokens per request maximising expected emitted tokens per second.

    ``base_tokens``: the step's tokens without drafts (one per decoding request plus prefill
    chunks); ``alphas[i]``: request ``i``'s acceptance estimate; ``max_drafts[i]``: the most
    drafts it has (drafter, ``num_speculative_tokens``, length limits). ``tier_costs`` are
    the costs of steps that verify drafts; ``base_cost``, when known, is what a step
    without drafts costs (plain decoding, which overlaps the host's work with the GPU's),
    else the staircase's cost of ``base_tokens``. Drafts are chosen only where their
    expected tokens per second beat plain decoding's by more than the share ``margin``.
    """
    n = len(alphas)
    tiers = np.array([t for t, _ in tier_costs])
    costs = np.array([c for _, c in tier_costs])
    i = int(np.searchsorted(tiers, base_tokens))
    if i == len(tiers) or not n:
        return [0] * n
    if base_cost is None:
        base_cost = float(costs[i])
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
    if rates[best] <= n / base_cost * (1 + max(margin, 1e-9)):
        return [0] * n
    return np.bincount(owner[order[:best + 1]], minlength=n).tolist()
