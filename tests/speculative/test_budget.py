"""The draft-budget chooser on synthetic cost staircases."""

from __future__ import annotations

import itertools
import random
from bisect import bisect_left
from collections.abc import Sequence

import pytest

from replaylm.speculative.budget import choose_budget


def step_cost(tier_costs: Sequence[tuple[int, float]], num_tokens: int) -> float | None:
    """Seconds of a step of ``num_tokens`` tokens, as ``choose_budget`` prices it: the cost
    of the smallest tier holding it (``tier_costs`` sorted by tier); None above the top
    tier."""
    i = bisect_left([t for t, _ in tier_costs], num_tokens)
    return tier_costs[i][1] if i < len(tier_costs) else None


def _rate(costs, base, alphas, ks):
    emitted = sum(sum(a ** j for j in range(k + 1)) for a, k in zip(alphas, ks))
    return emitted / step_cost(costs, base + sum(ks))


def test_batch_one_fills_its_tier_when_drafts_are_accepted():
    costs = [(8, 1.0), (16, 1.05), (32, 2.0)]
    assert choose_budget(costs, 1, [0.8], [7]) == [7]  # 8 tokens cost what 1 does
    assert choose_budget(costs, 1, [0.0], [7]) == [0]  # never accepted: plain decoding


def test_high_batch_falls_back_to_plain_decoding():
    # 64 decodes fill tier 64; any draft moves the step to tier 128 at twice the cost, and
    # even every request's best draft cannot double the tokens per step.
    costs = [(64, 1.0), (128, 2.0)]
    assert choose_budget(costs, 64, [0.9] * 64, [4] * 64) == [0] * 64
    # Above the top tier nothing is drafted.
    assert choose_budget(costs, 200, [0.9], [4]) == [0]


def test_drafts_go_to_the_requests_most_likely_to_accept():
    costs = [(4, 1.0), (8, 1.9)]
    # Two decodes, 2 draft tokens fit tier 4 for free: both go to the better request.
    assert choose_budget(costs, 2, [0.9, 0.3], [4, 4]) == [2, 0]


@pytest.mark.parametrize("seed", range(20))
def test_matches_brute_force(seed):
    rng = random.Random(seed)
    tiers = sorted(rng.sample(range(2, 24), 4))
    costs, c = [], 0.0
    for t in tiers:
        c += rng.uniform(0.1, 1.0)
        costs.append((t, c))
    n = rng.randint(1, 3)
    alphas = [rng.choice([0.0, rng.random()]) for _ in range(n)]
    maxk = [rng.randint(0, 4) for _ in range(n)]
    base = rng.randint(n, tiers[-1])
    got = choose_budget(costs, base, alphas, maxk)
    assert all(0 <= k <= m for k, m in zip(got, maxk))
    best = max(_rate(costs, base, alphas, ks)
               for ks in itertools.product(*(range(m + 1) for m in maxk))
               if base + sum(ks) <= tiers[-1])
    assert _rate(costs, base, alphas, got) == pytest.approx(best)
    assert _rate(costs, base, alphas, got) >= _rate(costs, base, alphas, [0] * n)


class _Req:
    def __init__(self, drafts, output=()):
        self.draft_tokens = list(drafts)
        self.output_token_ids = list(output)
        self.is_finished = False

    @property
    def num_output_tokens(self):
        return len(self.output_token_ids)


def test_adaptive_budget_learns_costs_and_acceptance():
    from replaylm.speculative import adaptive
    from replaylm.speculative.adaptive import PRIOR, AdaptiveBudget, eager_tiers

    assert eager_tiers(40) == [1, 2, 4, 8, 16, 32, 40]
    b = AdaptiveBudget([4, 8, 16], 4)
    reqs = [_Req([1, 2, 3]), _Req([4, 5])]
    assert b.choose(reqs, 2) == [0, 0] and b.coasting  # plain steps are measured first
    b.observe_step(4, 1.0, verified=False)
    reqs = [_Req([1, 2, 3]), _Req([4, 5])]
    # No verify measured: every tier is taken to cost what a plain step does (the least it
    # could), so every draft is tried.
    assert b.choose(reqs, 2) == [3, 2]
    assert AdaptiveBudget([4, 8, 16], 4).staircase(floor=1.0) == [(4, 1.0), (8, 1.0), (16, 1.0)]
    b.observe_step(4, 1.3, verified=True)
    b.observe_step(4, 9.0, verified=True)  # a pause inside the step: not what tier 4 costs
    assert b.costs[4] == pytest.approx(1.3)  # of two times the lesser
    b.observe_step(4, 1.4, verified=True)
    b.observe_step(4, 1.2, verified=True)
    assert b.costs[4] == pytest.approx(1.3)  # a typical time: the lower median
    b.observe_step(4, 1.5, verified=True)
    assert b.costs[4] == pytest.approx(1.4)  # of 1.2, 1.3, 1.4, 1.5 and 9.0
    for _ in range(adaptive.WINDOW):
        b.observe_step(4, 1.5, verified=True)
    assert b.costs[4] == pytest.approx(1.5)  # the window moved on
    for _ in range(adaptive.WINDOW):
        b.observe_step(4, 1.3, verified=True)
    # Unmeasured tiers cost what the largest measured one below costs: the most they could
    # gain, so the chooser tries them where that would pay.
    assert b.staircase() == [(4, pytest.approx(1.3)), (8, pytest.approx(1.3)),
                             (16, pytest.approx(1.3))]
    # The staircases are kept between steps: a cost that changes shows in the next one.
    for _ in range(adaptive.WINDOW // 2 + 1):
        b.observe_step(4, 1.1, verified=True)
    assert b.staircase()[0] == (4, pytest.approx(1.1))
    assert b.plain_cost(3) == pytest.approx(1.0)
    b.observe_step(4, 0.9, verified=False)
    assert b.plain_cost(3) == pytest.approx(0.9)
    lone = AdaptiveBudget([4, 8, 16], 4)
    lone.observe_step(8, 2.0, verified=True)
    # Tiers below every measured one: the floor given (a plain step's cost), else the lowest.
    assert lone.staircase(floor=1.0) == [(4, 1.0), (8, 2.0), (16, 2.0)]
    assert lone.staircase() == [(4, 2.0), (8, 2.0), (16, 2.0)]
    # A tier measured above a larger one costs what the larger one does.
    lone.observe_step(4, 2.5, verified=True)
    lone.observe_step(16, 2.2, verified=True)
    assert lone.staircase() == [(4, 2.0), (8, 2.0), (16, 2.2)]
    lone.observe_step(8, 1.8, verified=True)
    assert lone.staircase() == [(4, 1.8), (8, 1.8), (16, 2.2)]
    b.observe_step(8, 2.6, verified=True)
    b.observe_step(16, 5.2, verified=True)
    good, bad = _Req([1, 2, 3, 4]), _Req([5, 6, 7, 8])
    for _ in range(10):
        b.observe_verify(good, 4, 4)
        b.observe_verify(bad, 4, 0)
    assert good.spec_acceptance > 0.95 > PRIOR > 0.1 > bad.spec_acceptance
    # Tier 4 holds 2 base tokens + 2 drafts at the same cost: both go to the good request;
    # tier 8 costs twice as much, which the expected gains do not repay.
    assert b.choose([good, bad], 2) == [2, 0]
    assert good.draft_tokens == [1, 2] and bad.draft_tokens == [] and b.last_choice == 2
    assert not b.coasting
    # A request never measured starts from the running average over all requests.
    assert b.estimate(_Req([])) == pytest.approx(b.acceptance)


def test_plain_cost_decides_and_zero_choice_coasts():
    """Verifying pays against a plain step that costs the verify's tier, not against one
    that overlaps the host's work and costs half; choosing nothing starts coasting."""
    from replaylm.speculative.adaptive import AdaptiveBudget

    b = AdaptiveBudget([1, 2, 4, 8], 2)
    b.observe_step(4, 2.0, verified=True)
    b.observe_step(2, 1.0, verified=True)
    b.observe_step(1, 1.0, verified=True)
    r = _Req([7, 8])
    r.spec_acceptance = 0.6
    assert b.choose([r], 1) == [0]  # no plain step measured: plain decoding first
    b.observe_step(1, 1.0, verified=False)
    r.draft_tokens = [7, 8]
    assert b.choose([r], 1) == [1]  # 1.6 tokens per second against 1
    b._plain_times[1].clear()
    b.observe_step(1, 0.5, verified=False)  # plain overlapped steps: 2 tokens per second
    r.draft_tokens = [7, 8]
    assert b.choose([r], 1) == [0] and b.coasting and r.draft_tokens == []


def test_a_choice_says_what_it_expects_of_its_step():
    """``last_priced``: the tokens a chosen step is expected to emit (each request's one
    plus ``alpha + alpha**2 + ...`` for its drafts) and its tier's cost; None when no drafts
    are chosen, or there is nothing to choose."""
    from replaylm.speculative.adaptive import AdaptiveBudget, priced

    assert priced([(2, 1.0), (4, 2.0)], 1, [0.5, 1.0], [2, 1]) == (2 + 0.75 + 1.0, 2.0)
    b = AdaptiveBudget([1, 2, 4, 8], 2)
    b.observe_step(1, 1.0, verified=False)
    b.observe_step(2, 1.0, verified=True)
    r = _Req([7, 8])
    r.spec_acceptance = 0.6
    assert b.choose([r], 1) == [2]  # tier 4, above every measured one: costs what 2 does
    assert b.last_priced == pytest.approx((1 + 0.6 + 0.36, 1.0))
    assert b.choose([], 1) == [] and b.last_priced is None
    r.draft_tokens, r.spec_acceptance = [7, 8], 0.0
    assert b.choose([r], 1) == [0] and b.last_priced is None


def test_a_request_near_its_end_does_not_start_coasting():
    """One draft may not pay where four do: a request with room for one draft before its
    max_tokens runs its step plain, but the engine keeps verifying; a drafter that proposes
    one draft with room for four does start coasting."""
    from replaylm.speculative.adaptive import AdaptiveBudget

    b = AdaptiveBudget([1, 2, 4, 8], 4)
    b.observe_step(1, 1.0, verified=False)
    b.observe_step(2, 1.9, verified=True)
    b.observe_step(8, 2.0, verified=True)
    r = _Req([7])
    r.spec_acceptance = 0.8
    assert b.choose([r], 1, room=[1]) == [0] and not b.coasting  # 1.8 / 1.9 < 1 / 1.0
    r.draft_tokens = [7, 8, 9, 10]
    assert b.choose([r], 1, room=[4]) == [4] and not b.coasting  # 3.36 / 2.0 > 1 / 1.0
    r.draft_tokens = [7]
    assert b.choose([r], 1, room=[4]) == [0] and b.coasting  # the drafter had no more


def test_coasting_learns_from_shadow_proposals_and_ends():
    from replaylm.speculative import adaptive
    from replaylm.speculative.adaptive import AdaptiveBudget

    class Drafter:
        def __init__(self):
            self.calls = 0

        def propose(self, reqs, room):
            self.calls += 1
            return [[1, 2, 3][:k] for k in room]

    b = AdaptiveBudget([1, 2, 4], 3)
    b.observe_step(1, 1.0, verified=False)
    b.observe_step(4, 1.2, verified=True)
    b.observe_step(1, 1.0, verified=True)
    r = _Req([], output=[9])
    r.spec_acceptance = 0.0
    b.coasting = True
    d = Drafter()
    for _ in range(adaptive.SHADOW_EVERY - 1):
        b.shadow_round(d, lambda: ([r], [3]))
    assert d.calls == 0 and not b.shadow
    b.shadow_round(d, lambda: ([r], [3]))
    assert d.calls == 1 and b.shadow[r] == (1, [1, 2, 3])
    b.shadow_check(None, lambda: [r], lambda: 1)  # the guessed tokens are not known yet
    assert r in b.shadow and b.coasting
    r.output_token_ids += [1, 2]
    b.shadow_check(None, lambda: [r], lambda: 1)
    assert r in b.shadow
    r.output_token_ids += [3]  # all three guessed right: acceptance goes up
    b.shadow_check(None, lambda: [r], lambda: 1)
    # 3 accepted of 3 tried, after a prior of 0 of 1 trial that 3 tries scaled by DECAY**3
    assert r not in b.shadow
    assert r.spec_acceptance == pytest.approx(3 / (adaptive.DECAY ** 3 + 3))
    for _ in range(6):  # more right guesses until verifying 3 drafts beats plain decoding
        if not b.coasting:
            break
        for _ in range(adaptive.SHADOW_EVERY):
            b.shadow_round(d, lambda: ([r], [3]))
        r.output_token_ids += [1, 2, 3]
        b.shadow_check(None, lambda: [r], lambda: 1)
    assert not b.coasting and not b.shadow
    # A judge decides for the drafter (a drafter that knows its own drafts' fate).
    b.coasting = True
    for _ in range(adaptive.SHADOW_EVERY):
        b.shadow_round(d, lambda: ([r], [3]))
    r.output_token_ids += [0, 0, 0]
    est = r.spec_acceptance
    b.shadow_check(lambda req, drafts, actual: 3, lambda: [r], lambda: 1)
    assert r.spec_acceptance > est


def test_shadow_rounds_keep_to_their_share_of_the_plain_steps_time():
    """Once WINDOW rounds are measured, rounds that take half a plain step, on a host that
    does not wait for the device, come at most once per 1 / (2 * SHADOW_SHARE) steps, and
    never fewer than once per MAX_SHADOW_EVERY; cheap rounds, rounds that fit in the host's
    waits, one slow round among cheap ones, or slow rounds before WINDOW of them are
    measured, leave them every SHADOW_EVERY steps."""
    from replaylm.speculative import adaptive
    from replaylm.speculative.adaptive import WINDOW, AdaptiveBudget

    class Drafter:
        def __init__(self):
            self.calls = 0

        def propose(self, reqs, room):
            self.calls += 1
            return [[1] * k for k in room]

    def rounds(plain_s, round_s, n_rounds=WINDOW, waited=0.0, slow_last=None,
               then=4 * adaptive.SHADOW_EVERY):
        """``n_rounds`` rounds of ``round_s`` (then one of ``slow_last``), on a budget whose
        plain steps take ``plain_s`` and wait ``waited``; then the rounds in the next
        ``then`` steps, and the interval."""
        b = AdaptiveBudget([1, 2, 4], 3)
        for _ in range(50):  # the decayed mean wait settles
            b.observe_step(1, plain_s, verified=False, waited=waited)
        b.coasting = True
        reqs = [_Req([], output=[9]) for _ in range((n_rounds + 20) * adaptive.SHADOW_REQUESTS)]
        d = Drafter()

        def step(cost):  # none of the proposals is scored: fresh requests each round
            calls = d.calls
            b.shadow_round(d, lambda: (reqs, [3] * len(reqs)))
            b.add_shadow_time(cost if d.calls > calls else 0.0)  # what the call took

        for cost in [round_s] * n_rounds + ([] if slow_last is None else [slow_last]):
            before = d.calls
            while d.calls == before:  # coasting steps up to the next round
                step(cost)
        before = d.calls
        for _ in range(then):
            step(round_s)
        return d.calls - before, b.shadow_interval()

    assert rounds(10.0, 0.0) == (4, adaptive.SHADOW_EVERY)
    calls, interval = rounds(0.01, 0.005)
    assert calls == 0 and interval >= 0.5 / adaptive.SHADOW_SHARE - 1e-6
    assert rounds(0.01, 0.005, waited=0.008) == (4, adaptive.SHADOW_EVERY)
    assert rounds(0.01, 10.0)[1] == adaptive.MAX_SHADOW_EVERY
    assert rounds(10.0, 0.0, slow_last=10.0) == (4, adaptive.SHADOW_EVERY)
    # Too few rounds measured to tell a slow host from a preempted round.
    assert rounds(0.01, 10.0, n_rounds=WINDOW - 1, then=0) == (0, adaptive.SHADOW_EVERY)
    b = AdaptiveBudget([1, 2, 4], 3)
    b.observe_step(1, 0.01, verified=False)
    b.coasting = True
    b.shadow_round(Drafter(), lambda: ([], []))  # not a round's step: it did nothing
    b.add_shadow_time(1.0)
    b.shadow_check(None, lambda: [], lambda: 1)  # nothing to score
    b.add_shadow_time(1.0)
    assert b.shadow_interval() == adaptive.SHADOW_EVERY  # idle calls do not count


def test_a_cohort_beats_plain_decoding_of_every_request():
    """A pipelined cohort's drafts are priced by what cohort steps cost and must beat plain
    decoding of both cohorts in one step, not of the cohort alone."""
    from replaylm.speculative.adaptive import AdaptiveBudget

    b = AdaptiveBudget([1, 2, 4, 8], 1)
    b.observe_step(2, 1.0, verified=False)
    for tier in (2, 4):
        b.observe_step(tier, 1.2, verified=True)
        b.observe_step(tier, 0.6, verified=True, cohort=True)
    assert b.cohort_costs == {2: 0.6, 4: 0.6} and b.costs == {2: 1.2, 4: 1.2}

    def choice(others):
        r = _Req([1])
        r.spec_acceptance = 0.5
        return b.choose([r], 1, others=others)

    assert choice(others=0) == [1]  # synchronous: 1.5 / 1.2 against 1 / 1.0
    assert choice(others=1) == [1]  # a cohort: 1.5 / 0.6 against 2 / 1.0
    for tier in (2, 4):  # cohort steps cost more (the window forgets what it held)
        b._cohort_times[tier].clear()
        b.observe_step(tier, 0.8, verified=True, cohort=True)
    assert choice(others=1) == [0]  # 1.5 / 0.8 against 2 / 1.0


def test_drafts_stay_within_the_graphed_tiers():
    """A step that fits the graphed tiers never takes drafts past the top one (an eager step
    costs several graphed ones), even where the estimates say every tier is as cheap; a
    step already past them may add drafts on the eager tiers."""
    from replaylm.speculative.adaptive import AdaptiveBudget

    def budget(graph_top):
        b = AdaptiveBudget([1, 2, 4, 8, 16, 32], 8, graph_top=graph_top)
        b.observe_step(2, 1.0, verified=False)
        b.observe_step(16, 1.0, verified=False)
        return b

    def reqs():
        out = [_Req([1] * 8), _Req([1] * 8)]
        for r in out:
            r.spec_acceptance = 0.9
        return out

    assert sum(budget(None).choose(reqs(), 2)) == 16  # no graphs: every tier (2 + 16 <= 32)
    assert sum(budget(8).choose(reqs(), 2)) == 6  # 2 + 6 fills the top graphed tier
    assert sum(budget(8).choose(reqs(), 12)) == 16  # already eager: 12 + 16 <= 32


def test_margin_keeps_plain_decoding_where_drafts_barely_pay():
    # One request, 0.5 acceptance, 1 draft: 1.5 expected tokens; plain costs 1.0 per token.
    costs = [(1, 1.0), (2, 1.45)]
    assert choose_budget(costs, 1, [0.5], [1], base_cost=1.0) == [1]  # 1.034x plain
    assert choose_budget(costs, 1, [0.5], [1], base_cost=1.0, margin=0.05) == [0]
    assert choose_budget([(1, 1.0), (2, 1.4)], 1, [0.5], [1], base_cost=1.0,
                         margin=0.05) == [1]  # 1.071x plain


def test_coasting_ends_only_past_the_entry_margin_and_verifying_stays_to_break_even():
    """Hysteresis: shadow evidence ends coasting only where drafts are expected to beat plain
    decoding by ``ENTER_MARGIN``; once verifying, drafts are kept while they beat it at all."""
    from replaylm.speculative import adaptive
    from replaylm.speculative.adaptive import AdaptiveBudget

    class Drafter:
        def propose(self, reqs, room):
            return [[1] * k for k in room]

    b = AdaptiveBudget([1, 2], 1)
    b.observe_step(1, 1.0, verified=False)
    b.observe_step(2, 1.0 * 1.5 / (1 + adaptive.ENTER_MARGIN / 2), verified=True)
    r = _Req([], output=[9])
    b.coasting = True

    def shadow(right: bool) -> None:
        for _ in range(adaptive.SHADOW_EVERY):
            b.shadow_round(Drafter(), lambda: ([r], [1]))
        r.output_token_ids.append(1 if right else 0)
        r.spec_counts = (50.0, 100.0)  # long evidence: the estimate stays near 0.5
        b.shadow_check(lambda req, drafts, actual: int(right), lambda: [r], lambda: 1)

    shadow(right=True)  # at ~0.505 a draft gains about half the margin: coasting goes on
    d = adaptive.DECAY  # one more draft tried, and right
    assert b.coasting and r.spec_acceptance == pytest.approx((50 * d + 1) / (100 * d + 1))
    r.draft_tokens = [1]
    assert b.choose([r], 1) == [1] and not b.coasting  # a verifying engine keeps it


def test_false_starts_hold_coasting_longer():
    """Shadow evidence ended a stretch but the measured verify costs sent the chooser back
    at once: the next stretch must last SHORT_RUN, then twice that, before evidence counts;
    a run of verifies that pays clears the hold."""
    from replaylm.speculative import adaptive
    from replaylm.speculative.adaptive import AdaptiveBudget

    b = AdaptiveBudget([1, 2, 4, 8], 4)
    b.observe_step(1, 1.0, verified=False)
    r = _Req([], output=[9])

    def verify_costs(seconds):
        """Every verify tier measured at ``seconds`` (the window forgets what it held)."""
        for tier in (2, 4, 8):
            b._times.pop(tier, None)
            b.observe_step(tier, seconds, verified=True)

    verify_costs(1.0)
    r.spec_acceptance = 0.9

    class Drafter:
        def propose(self, reqs, room):
            return [[1] * k for k in room]

    def stretch(steps):
        """Coast ``steps`` steps with every shadow proposal right; whether coasting ended."""
        for _ in range(steps):
            b.shadow_round(Drafter(), lambda: ([r], [4]))
            if r in b.shadow:
                r.output_token_ids += [1] * 4
            b.shadow_check(None, lambda: [r], lambda: 1)
            if not b.coasting:
                return True
        return False

    b.coasting = True
    assert stretch(adaptive.SHADOW_EVERY)  # no hold yet: the first evidence ends it
    r.draft_tokens = [1, 1, 1, 1]
    verify_costs(50.0)  # verifies cost far more than thought...
    r.spec_acceptance = 0.9
    assert b.choose([r], 1) == [0] and b.coasting  # ...so back at once: a false start
    assert b.hold == adaptive.SHORT_RUN
    assert not stretch(adaptive.SHORT_RUN - 1)  # evidence does not count before the hold
    verify_costs(1.0)
    assert stretch(adaptive.SHADOW_EVERY + 1)
    verify_costs(50.0)
    r.draft_tokens = [1, 1, 1, 1]
    assert b.choose([r], 1) == [0] and b.hold == 2 * adaptive.SHORT_RUN
    verify_costs(1.0)
    assert stretch(2 * adaptive.SHORT_RUN)
    for _ in range(adaptive.SHORT_RUN):  # speculation pays for a while: the hold goes
        r.draft_tokens = [1, 1, 1, 1]
        assert b.choose([r], 1) == [4]
    assert b.hold == 0


@pytest.mark.parametrize("p", [0.3, 0.6, 0.8, 0.95])
def test_acceptance_estimate_tracks_the_per_draft_probability(p):
    """Each draft is accepted with probability ``p`` given the ones before it were: the
    estimate (over 400 verifies of 8 drafts, averaged over the last 300) must be ``p``, not
    the mean of each verify's accepted share, which sits well below it (0.8 gives ~0.6)."""
    import random

    from replaylm.speculative.adaptive import AdaptiveBudget

    rng = random.Random(int(p * 100))
    b = AdaptiveBudget([16], 8)
    r = _Req([])
    seen = []
    for i in range(400):
        accepted = 0
        while accepted < 8 and rng.random() < p:
            accepted += 1
        b.observe_verify(r, 8, accepted)
        if i >= 100:
            seen.append(r.spec_acceptance)
    assert sum(seen) / len(seen) == pytest.approx(p, abs=0.04)
    assert b.acceptance == r.spec_acceptance  # one request: the engine's ratio is its own


def test_small_choices_in_python_equal_numpys(monkeypatch):
    """Up to ``SMALL`` candidate drafts the chooser runs in plain Python; on random
    staircases (some whose top tier caps the drafts), acceptances (zeros, ones, ties) and
    margins it chooses what numpy does."""
    from replaylm.speculative import budget

    rng = random.Random(0)
    for _ in range(3000):
        tiers = sorted(rng.sample(range(1, rng.choice([50, 600])), rng.randint(1, 12)))
        tc = list(zip(tiers, sorted(rng.uniform(0.5e-3, 5e-3) for _ in tiers)))
        n = rng.randint(0, 8)
        alphas = [rng.choice([0.0, 1.0, 0.5, rng.random()]) for _ in range(n)]
        most = [rng.randint(0, 8) for _ in range(n)]
        args = (tc, rng.randint(1, 40), alphas, most,
                rng.choice([None, rng.uniform(0.3e-3, 3e-3)]), rng.choice([0.0, 0.02]))
        monkeypatch.setattr(budget, "SMALL", -1)
        want = budget.choose_budget(*args)
        monkeypatch.setattr(budget, "SMALL", 10**9)
        assert budget.choose_budget(*args) == want, args
