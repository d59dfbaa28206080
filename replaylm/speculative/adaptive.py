"""The adaptive draft budget: measured step costs per token tier and per-request acceptance
estimates feed ``budget.choose_budget`` every step, and decide when speculation pays at all.

Costs are learnt online as the wall time between the ends of consecutive steps, kept per
tier (a graph's token tier, or for eager steps the next power of two) as the lower median
of the last ``WINDOW`` times. The chooser compares expected rates, so a tier costs what its
steps typically take: the least time would price every tier below it, and verify steps
(noisier than overlapped plain ones) furthest below. One collection pause or compile does not
count (of two times, the lesser counts). ``costs`` for steps that verify
drafts and resolve before the next step is built, ``cohort_costs`` for pipelined ones (a
cohort's step, in flight while the other cohort's is built: ``speculative.pipeline``), and
``plain_costs`` for plain steps run with overlap scheduling (the CPU builds step N+1 while
the GPU runs step N), which is what decoding without speculation costs. A cohort's drafts
pay where its step's expected tokens per second beat plain decoding of every request in
one step, the other cohort's included. An unmeasured verify tier is taken to cost what a
line between the measured tiers on either side says; below every measured tier the line
starts from what a plain step costs (the least a verify could cost), and above them all it
stays at the highest one's cost. So the chooser tries an unmeasured tier where it would
pay at that estimate, and the step measures it; each measurement narrows the estimates of
the tiers around it, so a few tries find where speculation stops paying (with a flat
estimate below the lowest measured tier, the chooser would try every tier on the way down,
a bad step each at 64 requests). Drafts never take a step that fits the graphed tiers
(``graph_top``) past them: an eager step of that many tokens launches its kernels one by
one and costs several graphed steps, so even trying one costs more than it could win; a
step already past them without drafts (prefill chunks) may add drafts on the eager tiers.

Acceptance per request is the ratio of two decayed sums: drafts accepted and drafts tried
(a verify of ``k`` drafts that accepts ``a`` tried ``a + 1`` of them, or ``k`` when it
accepted all); each draft tried scales the evidence before it by ``DECAY``, so about the
latest ``1 / (1 - DECAY)`` drafts count. A ratio of sums estimates the per-draft acceptance
probability itself; an average of each verify's ratio would not (a run that accepts 0 of 1
and one that accepts 8 of 8 average to 1/2, not 8/9), and sits well below the truth. A
request not measured yet starts from the same ratio over all requests, worth one trial
(``PRIOR`` before any).

An engine starts coasting, so that plain steps are measured before any verify: a verify
step's cost says nothing about a plain one's, which overlaps the host's work.

Coasting: when a step's choice is zero drafts, speculation does not pay at the current
estimates, and the engine runs plain overlapped steps (no drafting, no host sync) until it
would. Meanwhile every ``SHADOW_EVERY`` steps a few requests get shadow proposals from the
drafter on their known tokens, never verified (a round's proposals and choices are host
work: while the host waits for the device less than a round would add per step, the
rounds come further apart, so that they take at most ``SHADOW_SHARE`` of the plain steps'
time, up to ``MAX_SHADOW_EVERY`` steps apart): once the tokens they guessed have been
generated, the leading matches (``Drafter.shadow_accepted`` where a drafter judges its own
proposals; otherwise known at the first token guessed wrong) update the acceptance
estimates for free, and when the chooser would then verify drafts at an expected rate
``ENTER_MARGIN`` above plain decoding's, coasting ends; a verifying engine keeps drafting
while drafts beat plain decoding at all (hysteresis: an estimate hovering near break-even
does not switch modes every few steps, each switch paying for steps that measure). When the
verify steps that follow measure costs that send it straight back (within ``SHORT_RUN``
choices: a false start), the next stretch lasts at least ``SHORT_RUN`` steps before shadow
evidence may end it, twice that after another false start and so on up to ``MAX_HOLD``
(``hold``); a longer run of verifies clears the hold. A drafter with device state (a draft
model) never coasts.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from replaylm.graphs.tiers import round_up
from replaylm.speculative.budget import choose_budget

PRIOR = 0.5  # acceptance assumed before anything is measured
DECAY = 0.98  # weight left to earlier evidence per draft tried
WINDOW = 8  # step costs: the lower median of this many latest times per tier
SHORT_RUN = 16  # verify steps after a shadow-ended stretch that count as a false start
MAX_HOLD = 64  # longest stretch a false start makes coasting keep
SHADOW_EVERY = 4  # coasting: fewest steps between rounds of shadow proposals
SHADOW_SHARE = 0.01  # coasting: most of the plain steps' time the rounds may take
MAX_SHADOW_EVERY = 64  # coasting: most steps between rounds (evidence at least this fresh)
PLAIN_WAIT_DECAY = 0.9  # weight left to the earlier plain steps' waits per step
SHADOW_REQUESTS = 8  # coasting: most requests given a shadow proposal per round
ENTER_MARGIN = 0.02  # coasting ends where drafts are expected to beat plain by this share


def eager_tiers(max_tokens: int) -> list[int]:
    """Powers of two up to ``max_tokens`` (and ``max_tokens``): eager steps' cost buckets."""
    tiers, t = [], 1
    while t < max_tokens:
        tiers.append(t)
        t *= 2
    return tiers + [max_tokens]


def _observe(times: dict[int, deque[float]], costs: dict[int, float], tier: int,
             seconds: float) -> None:
    window = times.setdefault(tier, deque(maxlen=WINDOW))
    window.append(seconds)
    costs[tier] = sorted(window)[(len(window) - 1) // 2]


def _decayed(counts: tuple[float, float], accepted: int, tried: int) -> tuple[float, float]:
    keep = DECAY ** tried
    return keep * counts[0] + accepted, keep * counts[1] + tried


def staircase(tiers: Sequence[int], measured: dict[int, float],
              floor: float | None = None) -> list[tuple[int, float]]:
    """(tier, seconds) for every tier of ``tiers`` (sorted): measured, or else interpolated
    linearly between the nearest measured tiers on either side (never below the one below);
    above every measured tier, what the highest costs. Below every measured tier the line
    starts from ``floor`` at the first tier (None: what the lowest measured tier costs).
    A measured tier costs at most what any larger measured tier does: a step of fewer
    tokens does not take longer, and a tier measured rarely can keep a slow time (a pause,
    a noisy neighbour) that would make the chooser avoid it. Empty when nothing is known."""
    if not measured and floor is None:
        return []
    known = sorted(measured.items())
    for j in range(len(known) - 2, -1, -1):  # capped by the tiers above
        if known[j][1] > known[j + 1][1]:
            known[j] = (known[j][0], known[j + 1][1])
    if not known or tiers[0] < known[0][0]:
        known.insert(0, (tiers[0], floor if floor is not None else known[0][1]))
    out, i = [], 0
    for t in tiers:
        while i + 1 < len(known) and known[i + 1][0] <= t:
            i += 1
        (a, ca), nxt = known[i], known[i + 1] if i + 1 < len(known) else None
        if t == a or nxt is None:
            out.append((t, ca))
        else:
            b, cb = nxt
            out.append((t, max(ca, ca + (cb - ca) * (t - a) / (b - a))))
    return out


def priced(stairs: Sequence[tuple[int, float]], base_tokens: int, alphas: Sequence[float],
           ks: Sequence[int]) -> tuple[float, float]:
    """What a choice expects of its step: the tokens it emits (each request's one, plus
    ``alpha + ... + alpha**k`` for ``k`` drafts accepted with probability ``alpha`` each
    given the ones before) and its price on ``stairs`` (the step's tier's cost)."""
    tokens = float(len(ks))
    for a, k in zip(alphas, ks):
        if k:
            tokens += k if a >= 1.0 else a * (1.0 - a ** k) / (1.0 - a)
    i = bisect_left([t for t, _ in stairs], base_tokens + sum(ks))
    return tokens, stairs[min(i, len(stairs) - 1)][1]


def leading_matches(drafts: Sequence[int], actual: Sequence[int]) -> int:
    """How many of ``drafts`` equal ``actual`` before the first that does not."""
    n = 0
    for d, a in zip(drafts, actual):
        if d != a:
            break
        n += 1
    return n


class AdaptiveBudget:
    def __init__(self, tiers: Sequence[int], num_speculative_tokens: int,
                 graph_top: int | None = None) -> None:
        self.tiers = sorted(set(tiers))
        self.k = num_speculative_tokens
        self.graph_top = graph_top  # the top graphed token tier (None: every step is eager)
        self.costs: dict[int, float] = {}  # verify steps: tier -> seconds
        self.cohort_costs: dict[int, float] = {}  # pipelined verify steps: tier -> seconds
        self.plain_costs: dict[int, float] = {}  # plain overlapped steps: tier -> seconds
        self._times: dict[int, deque[float]] = {}
        self._cohort_times: dict[int, deque[float]] = {}
        self._plain_times: dict[int, deque[float]] = {}
        # The latest staircase of each kind, with what it was built from: the chooser runs
        # every step, and the costs settle within a few steps.
        self._stairs: dict[bool, tuple[Any, list[tuple[int, float]]]] = {}
        self._plain_stairs: tuple[Any, dict[int, float]] = (None, {})
        self._counts = (PRIOR, 1.0)  # decayed (accepted, tried) over every request
        self.acceptance = PRIOR  # their ratio
        self.last_choice = 0  # draft tokens allowed by the latest choice (all requests)
        # What the latest choice of drafts expects of its step: (tokens, seconds); ``priced``.
        self.last_priced: tuple[float, float] | None = None
        self.coasting = False
        self.shadow: dict[Any, tuple[int, list[int]]] = {}  # request -> (output index, drafts)
        self._since_shadow = 0
        # Host seconds of the latest WINDOW shadow rounds (proposals, then choices).
        self._round_costs: deque[float] = deque(maxlen=WINDOW)
        self._worked = False  # the latest shadow call proposed or scored (add_shadow_time)
        self._plain_s = 0.0  # what the latest plain step's tier costs
        self._plain_wait = 0.0  # decayed mean wait for the device in plain steps (seconds)
        self.hold = 0  # coasting steps before shadow evidence may end a stretch
        self._coasted = 0  # steps of the current coasting stretch
        self._verify_run: int | None = None  # choices since a shadow-ended stretch

    def tier_of(self, num_tokens: int) -> int | None:
        return round_up(self.tiers, num_tokens)

    def observe_step(self, tier: int | None, seconds: float, verified: bool,
                     cohort: bool = False, waited: float = 0.0) -> None:
        """A step's wall time (end of the previous step to end of this one); ``cohort``: a
        pipelined verify step; ``waited``: the part the host spent waiting for the
        device."""
        if tier is None:
            return
        if verified and cohort:
            _observe(self._cohort_times, self.cohort_costs, tier, seconds)
        elif verified:
            _observe(self._times, self.costs, tier, seconds)
        else:
            _observe(self._plain_times, self.plain_costs, tier, seconds)
            self._plain_s = self.plain_costs[tier]
            self._plain_wait += (1 - PLAIN_WAIT_DECAY) * (waited - self._plain_wait)

    def estimate(self, req: Any) -> float:
        return getattr(req, "spec_acceptance", self.acceptance)

    def observe_verify(self, req: Any, drafts: int, accepted: int) -> None:
        tried = accepted + (1 if accepted < drafts else 0)
        counts = getattr(req, "spec_counts", None) or (self.estimate(req), 1.0)
        req.spec_counts = _decayed(counts, accepted, tried)
        req.spec_acceptance = req.spec_counts[0] / req.spec_counts[1]
        self._counts = _decayed(self._counts, accepted, tried)
        self.acceptance = self._counts[0] / self._counts[1]

    def staircase(self, floor: float | None = None, cohort: bool = False,
                  ) -> list[tuple[int, float]]:
        """Verify steps' costs per tier (``floor``: below every measured tier; ``cohort``:
        pipelined ones')."""
        costs = self.cohort_costs if cohort else self.costs
        key = (floor, tuple(costs.items()))
        cached = self._stairs.get(cohort)
        if cached is None or cached[0] != key:
            cached = self._stairs[cohort] = (key, staircase(self.tiers, costs, floor))
        return cached[1]

    def plain_cost(self, num_tokens: int) -> float | None:
        """Seconds of a plain overlapped step of ``num_tokens`` tokens (None: not measured)."""
        tier = self.tier_of(num_tokens)
        key = tuple(self.plain_costs.items())
        if self._plain_stairs[0] != key:
            self._plain_stairs = (key, dict(staircase(self.tiers, self.plain_costs)))
        return self._plain_stairs[1].get(tier) if tier is not None else None

    def _choice(self, reqs: Sequence[Any], base_tokens: int, max_drafts: list[int],
                margin: float = 0.0, others: int = 0,
                ) -> tuple[list[int], tuple[float, float] | None]:
        """The drafts per request, and what the step is expected to emit and cost where it
        verifies any (``priced``). ``others``: the other cohort's decoding tokens (a
        pipelined step), which plain decoding would run in the same step."""
        base_cost = self.plain_cost(base_tokens)
        plain_cost = self.plain_cost(base_tokens + others)
        if base_cost is None or plain_cost is None:  # plain decoding first: the rate to beat
            return [0] * len(reqs), None
        stairs = self.staircase(floor=base_cost, cohort=others > 0)
        if self.graph_top is not None and base_tokens <= self.graph_top:
            stairs = stairs[:bisect_right(self.tiers, self.graph_top)]
        alphas = [self.estimate(r) for r in reqs]
        ks = choose_budget(stairs, base_tokens, alphas, max_drafts, base_cost=base_cost,
                           margin=margin, base_rate=(len(reqs) + others) / plain_cost)
        return ks, priced(stairs, base_tokens, alphas, ks) if sum(ks) else None

    def choose(self, reqs: Sequence[Any], base_tokens: int,
               room: Sequence[int] | None = None, others: int = 0) -> list[int]:
        """Trim each request's ``draft_tokens`` to its share of this step's budget; returns
        the draft counts kept. ``reqs``: the requests with room for a draft (those without
        proposals keep none), ``room``: how many drafts each has room for before its
        ``max_tokens``, ``others``: a pipelined step's other cohort (its decoding tokens).
        With no request (a prefill step, or only requests at their last token) there is
        nothing to decide and the state stays. Before any plain step is measured, none are
        kept (the plain steps that follow measure what speculation has to beat). A choice
        of none starts coasting, unless it is none only because requests near their end
        have room for fewer than ``num_speculative_tokens`` drafts (one draft may not pay
        where eight do): that step runs plain and the state stays."""
        self.last_priced = None
        if not reqs:
            return []
        most = [len(r.draft_tokens) for r in reqs]
        ks, self.last_priced = self._choice(reqs, base_tokens, most, others=others)
        for r, k in zip(reqs, ks):
            del r.draft_tokens[k:]
        self.last_choice = sum(ks)
        if not self.last_choice and room is not None:
            full = [self.k if n == m < self.k else n for n, m in zip(most, room)]
            if full != most and sum(self._choice(reqs, base_tokens, full, others=others)[0]):
                return ks
        self.coasting = not self.last_choice
        if self._verify_run is not None:
            self._verify_run += 1
            if self._verify_run >= SHORT_RUN:  # speculation paid for a while: no hold
                self.hold, self._verify_run = 0, None
        if not self.last_choice:
            if self._verify_run is not None:  # a false start: hold the next stretch longer
                self.hold = min(MAX_HOLD, max(SHORT_RUN, 2 * self.hold))
                self._verify_run = None
            self._since_shadow = self._coasted = 0
        return ks

    # Coasting -------------------------------------------------------------------------------

    def shadow_round(self, drafter: Any,
                     candidates: Callable[[], tuple[Sequence[Any], Sequence[int]]]) -> None:
        """One coasting step. Every :meth:`shadow_interval` of them: proposals for up to
        ``SHADOW_REQUESTS`` of the ``candidates()`` (requests with output, and how many
        drafts each has room for) that have none outstanding; the other steps read no
        request."""
        self._since_shadow += 1
        self._coasted += 1
        if self._since_shadow < self.shadow_interval():
            return
        self._since_shadow = 0
        self._round_costs.append(0.0)
        self._worked = True
        reqs, room = candidates()
        pick = [(r, k) for r, k in zip(reqs, room) if k > 0 and r not in self.shadow]
        pick = pick[:SHADOW_REQUESTS]
        if pick:
            for (r, _), drafts in zip(pick, drafter.propose([r for r, _ in pick],
                                                            [k for _, k in pick])):
                if drafts:
                    self.shadow[r] = (r.num_output_tokens, list(drafts))

    def add_shadow_time(self, seconds: float) -> None:
        """Host seconds the latest ``shadow_round`` or ``shadow_check`` call took (the
        caller's clock, as for ``observe_step``). A call that proposed or scored counts
        toward the round's cost, which :meth:`shadow_interval` weighs; the others' few
        microseconds come every step, however far apart the rounds are."""
        if self._worked and self._round_costs:
            self._round_costs[-1] += seconds
        self._worked = False

    def shadow_interval(self) -> int:
        """Coasting steps from one shadow round to the next: ``SHADOW_EVERY`` while a round
        (its proposals and choices: the least of the latest ``WINDOW``, so one preempted
        round does not space the next ones out; ``SHADOW_EVERY`` until that many are
        measured) fits in the host's waits for the device over that many
        plain steps, else as many as keep it within ``SHADOW_SHARE`` of the plain steps'
        time, up to ``MAX_SHADOW_EVERY``."""
        full = len(self._round_costs) == WINDOW
        round_s = min(self._round_costs) if full else 0.0
        if not self._plain_s or round_s <= SHADOW_EVERY * self._plain_wait:
            return SHADOW_EVERY
        return min(MAX_SHADOW_EVERY,
                   max(SHADOW_EVERY, math.ceil(round_s / (SHADOW_SHARE * self._plain_s))))

    def shadow_check(self, judge: Callable[[Any, list[int], list[int]], int] | None,
                     running: Callable[[], Sequence[Any]],
                     base_tokens: Callable[[], int], pipelined: bool = False) -> None:
        """Score the shadow proposals whose tokens are now known, and end coasting when
        the chooser would verify drafts at the updated estimates (``running()``: the
        requests with output, ``base_tokens()``: the next step's tokens without drafts; both
        read only when a proposal was scored; ``pipelined``: verify steps would run as two
        cohorts, so the choice is a cohort's)."""
        scored = False
        for req, (at, drafts) in list(self.shadow.items()):
            if req.is_finished:
                del self.shadow[req]
                continue
            actual = req.output_token_ids[at: at + len(drafts)]
            if judge is not None:
                if len(actual) < len(drafts):
                    continue
                accepted = judge(req, drafts, actual)
            else:  # decided at the first known miss, or once every guess is known
                accepted = leading_matches(drafts, actual)
                if accepted == len(actual) < len(drafts):
                    continue
            del self.shadow[req]
            self.observe_verify(req, len(drafts), accepted)
            scored = self._worked = True
        if not scored or self._coasted < self.hold:
            return
        reqs = running()
        others = len(reqs) // 2 if pipelined else 0  # the cohort verifying next
        cohort = reqs[:len(reqs) - others]
        enter = bool(reqs) and sum(self._choice(cohort, max(1, base_tokens() - others),
                                                [self.k] * len(cohort), ENTER_MARGIN,
                                                others)[0]) > 0
        if enter:
            self.coasting = False
            self.shadow.clear()
            self._verify_run = 0
