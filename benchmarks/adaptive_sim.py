"""The adaptive draft budget against fixed K, simulated on step costs measured on the H200.

``replaylm.speculative.adaptive.AdaptiveBudget`` is driven exactly as ``EngineCore.step`` drives it
(proposals trimmed by ``choose``, step costs fed to ``observe_step``, verify outcomes to
``observe_verify``, coasting with shadow proposals judged by the drafter), but steps cost
what a cost model says instead of running a model, and each draft is accepted with
probability ``p`` given the ones before it were (the controlled drafter of ``bench spec``).
So the policy can be tried at every acceptance rate and batch size in seconds on a CPU, and
a change to it compared with fixed K before it takes device time.

The cost models (``SCENARIOS``) are fits to ``replaylm bench spec`` rows on the H200
(llama3.2-1b and llama3-8b shapes, ``ragged``, 2026-12-01): a plain step (overlapped) and a
verify step of ``t`` tokens (resolved before the next is built, so its host work shows).

    PYTHONPATH=. python benchmarks/adaptive_sim.py [--scenario 1b-b1] [--tokens 256]
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from dataclasses import dataclass

from replaylm.graphs.tiers import default_token_tiers, round_up, verify_token_tiers
from replaylm.speculative.adaptive import AdaptiveBudget

#: The token tiers a speculative ``ragged`` engine captures at the default 512 graph tokens
#: (``GraphPolicy.resolve(..., speculative=True)``).
TIERS = sorted({*default_token_tiers(512), *verify_token_tiers(512)})


@dataclass(frozen=True)
class Scenario:
    batch: int
    plain_ms: float  # a plain decode step of ``batch`` tokens, overlapped
    verify_ms: Callable[[int], float]  # a verify step of ``t`` tokens


SCENARIOS: dict[str, Scenario] = {
    # 1B at batch 1: fixed K=1/4/8 at p=0.95 ran 1.34/1.48/1.86 ms per verify; plain 0.87.
    "1b-b1": Scenario(1, 0.87, lambda t: 1.35 + 0.06 * (t - 2)),
    # 8B at batch 1: plain 4.07 ms; fixed K=8 at p=0.8 ran 5.7 ms per verify.
    "8b-b1": Scenario(1, 4.07, lambda t: 5.2 + 0.05 * (t - 2)),
    # 1B at 64 requests: plain 1.25 ms; fixed K=1/2/4 at p=0.95 ran 4.1/5.1/5.3 ms per
    # verify (64 requests' verify bookkeeping on the host shows); K=8 (576 tokens, above the
    # top graph tier) ran eagerly at 17.5 ms.
    "1b-b64": Scenario(64, 1.25, lambda t: 3.2 + 0.0065 * t if t <= 512 else 17.0),
}


class _Req:
    def __init__(self, max_tokens: int) -> None:
        self.output_token_ids: list[int] = []
        self.draft_tokens: list[int] = []
        self.max_tokens = max_tokens
        self.marks: list[bool] = []

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.num_output_tokens >= self.max_tokens

    def room(self, k: int) -> int:
        return max(0, min(k, self.max_tokens - self.num_output_tokens - 1))


class _Drafter:
    """Drafts ``room`` tokens; each is right with probability ``p`` given those before it."""

    def __init__(self, p: float, rng: random.Random) -> None:
        self.p, self.rng = p, rng

    def propose(self, reqs: list[_Req], room: list[int]) -> list[list[int]]:
        out = []
        for r, k in zip(reqs, room):
            r.marks = [self.rng.random() < self.p for _ in range(k)]
            out.append([0] * k)
        return out

    @staticmethod
    def accepted(req: _Req, k: int) -> int:
        marks = req.marks[:k]
        return marks.index(False) if False in marks else len(marks)

    def shadow_accepted(self, req: _Req, drafts: list[int], actual: list[int]) -> int:
        return self.accepted(req, len(drafts))


def run(sc: Scenario, p: float, policy: str, tokens: int, seed: int = 0,
        budget: AdaptiveBudget | None = None) -> tuple[float, AdaptiveBudget | None]:
    """Output tokens per ms of ``policy`` (``plain``, ``k1`` .. ``k8``, ``adaptive``) for
    ``sc.batch`` requests of ``tokens`` tokens each; ``budget`` carries an adaptive budget's
    state over from an earlier run (as one engine serving changing traffic)."""
    rng = random.Random(seed)
    drafter = _Drafter(p, rng)
    reqs = [_Req(tokens) for _ in range(sc.batch)]
    k_max = 8 if policy == "adaptive" else (int(policy[1:]) if policy != "plain" else 0)
    if policy == "adaptive" and budget is None:
        budget = AdaptiveBudget(TIERS, k_max)
    # The prefill step: no request decodes yet, so none drafts (the chooser has nothing to
    # decide); it costs about a plain step and samples each request's first token.
    elapsed = sc.plain_ms
    for r in reqs:
        r.output_token_ids.append(0)
    while not all(r.is_finished for r in reqs):
        live = [r for r in reqs if not r.is_finished]
        coasting = budget is not None and budget.coasting
        drafts = [0] * len(live)
        if k_max and not coasting:
            room = [r.room(k_max) for r in live]
            props = drafter.propose(live, room)
            for r, d in zip(live, props):
                r.draft_tokens = d
            if budget is not None:  # as Speculation._propose_drafts: those with room
                able = [(r, k) for r, k in zip(live, room) if k]
                budget.choose([r for r, _ in able], len(live), [k for _, k in able])
            drafts = [len(r.draft_tokens) for r in live]
        elif coasting:
            budget.shadow_round(drafter, lambda live=live: (live, [r.room(k_max) for r in live]))
        verified = sum(drafts) > 0
        n = len(live) + sum(drafts)
        cost = sc.verify_ms(n) if verified else sc.plain_ms * len(live) / sc.batch
        elapsed += cost
        for r, k in zip(live, drafts):
            a = drafter.accepted(r, k) if k else 0
            if k and budget is not None:
                budget.observe_verify(r, k, a)
            r.output_token_ids += [0] * min(a + 1, r.max_tokens - r.num_output_tokens)
            r.draft_tokens = []
        if budget is not None:
            budget.observe_step(round_up(TIERS, n) or n, cost * 1e-3, verified)
            if budget.coasting and budget.shadow:
                budget.shadow_check(drafter.shadow_accepted, lambda live=live: live,
                                    lambda live=live: len(live))
    return sum(r.num_output_tokens for r in reqs) / elapsed, budget


def table(name: str, ps: list[float], tokens: int, warmup: int, seed: int = 0) -> list[dict]:
    """Every policy at every ``p``; the adaptive budget carries its state from point to
    point (after a ``warmup``-token run at the same ``p``), as in ``bench spec``."""
    sc = SCENARIOS[name]
    rows, budget = [], None
    for p in ps:
        plain, _ = run(sc, p, "plain", tokens)
        fixed = {f"k{k}": run(sc, p, f"k{k}", tokens, seed=seed + k)[0] for k in (1, 2, 4, 8)}
        _, budget = run(sc, p, "adaptive", warmup, seed=seed + 99, budget=budget)
        adaptive, budget = run(sc, p, "adaptive", tokens, seed=seed + 7, budget=budget)
        best = max(fixed, key=fixed.get)
        rows.append({"scenario": name, "p": p, "plain": plain, **fixed, "adaptive": adaptive,
                     "best_fixed": best, "vs_best": adaptive / max(fixed[best], plain),
                     "vs_plain": adaptive / plain})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", action="append", choices=sorted(SCENARIOS))
    ap.add_argument("--acceptance", default="0,0.3,0.6,0.8,0.95")
    ap.add_argument("--tokens", type=int, default=256, help="output tokens per request")
    ap.add_argument("--warmup", type=int, default=64, help="tokens of the untimed run")
    ns = ap.parse_args(argv)
    ps = [float(x) for x in ns.acceptance.split(",")]
    for name in ns.scenario or list(SCENARIOS):
        print(f"{name}: output tokens/ms; adaptive against max(best fixed K, plain)")
        for r in table(name, ps, ns.tokens, ns.warmup):
            fixed = "  ".join(f"{k} {r[k]:6.2f}" for k in ("k1", "k2", "k4", "k8"))
            print(f"  p={r['p']:<4}  plain {r['plain']:6.2f}  {fixed}  adaptive "
                  f"{r['adaptive']:6.2f}  x{r['vs_best']:.3f} of best ({r['best_fixed']}), "
                  f"x{r['vs_plain']:.3f} of plain")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
