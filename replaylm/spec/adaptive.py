"""The adaptive draft budget: measured step costs per token tier and per-request acceptance
estimates feed ``budget.choose_budget`` every step.

Costs are learnt online: while speculation is on each step is resolved before the next one
is built, so its wall time (launch to samples on the host) is the step's cost; it is kept
per tier (a graph's token tier, or for eager steps the next power of two) as a moving
average. A tier not measured yet is estimated from the nearest measured one below it,
scaled by the token ratio (above it: that tier's cost), so larger tiers are tried when they
look worth it and then measured. Acceptance per request is a moving average of the share of
its drafts accepted, starting at ``PRIOR``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from replaylm.spec.budget import choose_budget

PRIOR = 0.5  # acceptance assumed for a request before its first verify
WEIGHT = 0.3  # weight of the newest observation in the moving averages


def eager_tiers(max_tokens: int) -> list[int]:
    """Powers of two up to ``max_tokens`` (and ``max_tokens``): eager steps' cost buckets."""
    tiers, t = [], 1
    while t < max_tokens:
        tiers.append(t)
        t *= 2
    return tiers + [max_tokens]


class AdaptiveBudget:
    def __init__(self, tiers: Sequence[int]) -> None:
        self.tiers = sorted(set(tiers))
        self.costs: dict[int, float] = {}  # tier -> seconds (moving average)
        self.last_choice = 0  # draft tokens allowed by the latest choice (all requests)

    def tier_of(self, num_tokens: int) -> int | None:
        return next((t for t in self.tiers if t >= num_tokens), None)

    def observe_step(self, tier: int | None, seconds: float) -> None:
        if tier is None:
            return
        old = self.costs.get(tier)
        self.costs[tier] = seconds if old is None else old + WEIGHT * (seconds - old)

    @staticmethod
    def observe_verify(req: Any, drafts: int, accepted: int) -> None:
        trials = accepted + (1 if accepted < drafts else 0)
        est = getattr(req, "spec_acceptance", PRIOR)
        req.spec_acceptance = est + WEIGHT * (accepted / trials - est)

    def staircase(self) -> list[tuple[int, float]]:
        """(tier, seconds) for every tier: measured, or estimated from a measured one."""
        measured = sorted(self.costs.items())
        if not measured:
            return []
        out = []
        for t in self.tiers:
            if t in self.costs:
                out.append((t, self.costs[t]))
                continue
            below = [(mt, c) for mt, c in measured if mt < t]
            mt, c = below[-1] if below else measured[0]
            out.append((t, c * t / mt if below else c))
        return out

    def choose(self, reqs: Sequence[Any], base_tokens: int) -> list[int]:
        """Trim each request's ``draft_tokens`` to its share of this step's budget; returns
        the draft counts kept. Before any cost is measured, drafts are kept as proposed."""
        costs = self.staircase()
        if not costs:
            ks = [len(r.draft_tokens) for r in reqs]
        else:
            ks = choose_budget(costs, base_tokens,
                               [getattr(r, "spec_acceptance", PRIOR) for r in reqs],
                               [len(r.draft_tokens) for r in reqs])
        for r, k in zip(reqs, ks):
            del r.draft_tokens[k:]
        self.last_choice = sum(ks)
        return ks
