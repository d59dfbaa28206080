"""The speculative step: drafts proposed before scheduling, verified in the step, resolved at
once, or, pipelined, resolved in the next step while the other cohort's is built
(``speculative.pipeline``); with the adaptive budget, plain overlapped steps while
speculation does not pay.

``EngineCore.step`` hands the whole step here when ``speculative_config`` is set. What a
verify does on the device (the acceptance rule, the padded layout) is the model runner's;
which drafts to verify is ``speculative.adaptive``'s; this module only orders the step.
"""

from __future__ import annotations

import time
from collections.abc import Collection

from replaylm.engine.draft_model import DraftModelDrafter
from replaylm.engine.draft_runner import DraftModelRunner
from replaylm.engine.launched import Launched, StepHost
from replaylm.engine.outputs import RequestDelta
from replaylm.engine.request import Request
from replaylm.speculative.adaptive import AdaptiveBudget, eager_tiers
from replaylm.speculative.config import SpecConfig
from replaylm.speculative.drafter import make_drafter
from replaylm.speculative.pipeline import VerifyPipeline
from replaylm.speculative.protocol import Drafter
from replaylm.speculative.stats import SpecStats


class Speculation:
    """The drafter, its counters and the budget of one engine, and the step that uses them."""

    def __init__(self, core: StepHost, spec: SpecConfig,
                 draft_runner: DraftModelRunner | None) -> None:
        self.core = core
        self.spec = spec
        runner = core.runner
        self.stats = SpecStats(spec.num_speculative_tokens, spec.budget, spec.verify)
        self.drafter: Drafter
        if draft_runner is not None:
            drafter = DraftModelDrafter(draft_runner, spec, runner.num_blocks,
                                        core.max_model_len, runner.sampler.state, self.stats)
            core.scheduler.on_release = drafter.release
            self.use(drafter)
        else:
            self.use(make_drafter(spec))
        # The top graphed token tier (0: none), past which a step runs eagerly.
        self._graph_top = max(runner.policy.token_tiers, default=0)
        self.budget: AdaptiveBudget | None = None
        if spec.budget == "adaptive":
            top = runner.policy.top_tier
            tiers = runner.policy.token_tiers + [
                t for t in eager_tiers(core.args.max_num_batched_tokens) if t > top]
            self.budget = AdaptiveBudget(tiers, spec.num_speculative_tokens,
                                         graph_top=self._graph_top or None)
        # Overlap scheduling (``EngineCore.overlap``) is for drafters without device state:
        # plain steps while the adaptive budget coasts, and pipelined verify steps.
        self.overlaps = draft_runner is None
        self.pipeline: VerifyPipeline | None = None
        if self.overlaps and core.args.overlap_scheduling and (
                spec.pipeline == "on"
                or (spec.pipeline == "auto" and runner.device.type == "cuda")):
            self.pipeline = VerifyPipeline(spec.pipeline)
        self._last_end: float | None = None  # end of the previous step that launched work
        self._waited = 0.0  # this step's wait for the device (seconds)
        self._emitted = 0  # tokens emitted by the verify steps resolved in this step

    def use(self, drafter: Drafter) -> None:
        """Propose drafts with ``drafter`` from the next step on; the rest of the configuration
        (``num_speculative_tokens``, budget, verify layout) stays. A drafter with an
        ``acceptance`` method decides its verify rows' tokens with it
        (``ModelRunner.verify_accept``). Benchmarks use it for drafters with a known
        acceptance rate (``replaylm.bench.spec``)."""
        self.drafter = drafter
        self.core.runner.verify_accept = getattr(drafter, "acceptance", None)

    def step(self) -> tuple[Launched | None, list[RequestDelta]]:
        """One step: propose drafts (or, coasting, a shadow round), launch, resolve. A step
        that verifies drafts resolves before returning unless it is pipelined (one cohort's
        step stays in flight while the next call builds the other's); a plain one may stay
        in flight."""
        core, budget, pipeline = self.core, self.budget, self.pipeline
        deltas: list[RequestDelta] = []
        hold: set[Request] = set()
        self._waited, self._emitted = 0.0, 0
        if budget is not None and budget.coasting and core.overlap:
            # Coasting starts on a step that chose no drafts: what it leaves in flight is
            # plain (a pipelined one resolved the other cohort's verify).
            self._shadow_round()
        elif pipeline is not None and pipeline.active:
            hold = self._propose_cohort(pipeline)
        else:
            if core.inflight is not None:  # drafts continue every request's latest token
                deltas += self._resolve(core.due(None, keep_in_flight=False)[0])
                self._last_end = None  # this step's time includes the previous one's wait
            self._propose_drafts()
        out = core.scheduler.schedule(hold)
        launched, errors = core.launch(out)
        deltas += errors
        if launched is not None:
            self.stats.record_launch(out.scheduled, out.num_batched_tokens, launched.padded,
                                     core.runner.layout_pad_tokens)
        verified = launched is not None and any(s.drafts for s in out.scheduled)
        # Pipelined, the step stays in flight while held requests can go next (the other
        # cohort, resolved below, or ready ones beyond this cohort); else nothing overlaps it.
        keep = core.overlap and (not verified or bool(hold))
        if verified and keep:
            self.stats.pipelined_steps += 1
        due = core.due(launched, keep_in_flight=keep)
        for step in due:
            deltas += self._resolve(step)
        now = time.perf_counter()
        if budget is not None:
            self._observe(budget, launched, due, verified, keep, now)
        if verified and self._last_end is not None:
            wall = now - self._last_end
            if due:
                self.stats.measured_steps += 1
                self.stats.measured_tokens += self._emitted
                self.stats.measured_seconds += wall
            if pipeline is not None:  # ``VerifyPipeline.observe``: host time and wait
                pipeline.observe(wall - self._waited, self._waited,
                                 sync_eager=self._sync_eager(launched, pipelined=keep))
        self._last_end = now if launched is not None else None
        if budget is not None and budget.coasting and budget.shadow:
            t0 = time.perf_counter()
            budget.shadow_check(getattr(self.drafter, "shadow_accepted", None),
                                self._generating, self._base_tokens,
                                pipelined=pipeline is not None and pipeline.active)
            budget.add_shadow_time(time.perf_counter() - t0)
        return launched, deltas

    def _sync_eager(self, launched: Launched, pipelined: bool) -> bool:
        """Whether a synchronous verify of every request would pass the top graphed tier
        while a cohort's (half of them) fits it, judged from this verify step's tokens
        (``VerifyPipeline.observe``). Fixed K only: the adaptive budget keeps a step that
        fits the graphed tiers within them (``AdaptiveBudget.graph_top``)."""
        if self.budget is not None or not self._graph_top:
            return False
        tokens = launched.out.num_batched_tokens
        sync, cohort = (2 * tokens, tokens) if pipelined else (tokens, -(-tokens // 2))
        return cohort <= self._graph_top < sync

    def _resolve(self, step: Launched) -> list[RequestDelta]:
        t0 = time.perf_counter()
        sampled = self.core.wait(step)
        self._waited += time.perf_counter() - t0
        verified = self.stats.record_resolve(step.out.scheduled, sampled)
        if verified:  # each sampling request's token, then its accepted drafts
            self._emitted += (sum(1 for s in step.out.scheduled if s.sample)
                              + sum(a for _, _, a in verified))
        if self.budget is not None:
            for req, k, accepted in verified:
                self.budget.observe_verify(req, k, accepted)
        return self.core.apply(step, sampled)

    def _observe(self, budget: AdaptiveBudget, launched: Launched | None,
                 due: list[Launched], verified: bool, in_flight: bool, now: float) -> None:
        """The step's cost: end of the previous step to the end of this one (``now``),
        counted where it includes a wait for the GPU (plain with overlap: the previous
        step's; a pipelined cohort's: the other cohort's; otherwise its own, after a step
        that left nothing in flight)."""
        steady = bool(due) and (verified or not self.core.overlap or due[0] is not launched)
        if launched is not None and self._last_end is not None and steady:
            tier = (launched.dispatch.tier if launched.dispatch.graphed
                    else budget.tier_of(launched.out.num_batched_tokens))
            budget.observe_step(tier, now - self._last_end, verified, cohort=in_flight,
                                waited=self._waited)

    # Drafting ------------------------------------------------------------------------------

    def _decoding(self) -> list[Request]:
        """Running requests whose next step decodes one token (the ones that may draft).
        Requests with structured outputs never draft: a verify would need a grammar mask per
        row, each from the drafts before it (``structured.masks``)."""
        return [r for r in self.core.scheduler.running
                if r.num_tokens - r.num_computed_tokens == 1 and r.num_output_tokens
                and r.grammar is None and not r.num_pending]

    def _generating(self) -> list[Request]:
        """Running requests with output tokens (with a step in flight, a decoding request's
        next token is pending: ``_decoding`` does not list it)."""
        return [r for r in self.core.scheduler.running if r.num_output_tokens]

    def _draft_room(self, reqs: list[Request]) -> list[int]:
        k = self.spec.num_speculative_tokens
        return [min(k, r.max_tokens - r.num_generated - 1) for r in reqs]

    def _base_tokens(self, hold: Collection[Request] = ()) -> int:
        """The next step's tokens without drafts, as the scheduler will likely lay them out:
        every running request's uncomputed tokens (but ``hold``'s), then waiting prompts, in
        the budget."""
        sched = self.core.scheduler
        base = sum(r.num_tokens - r.num_computed_tokens for r in sched.running
                   if r not in hold)
        base += sum(r.num_tokens - r.num_computed_tokens for r in sched.waiting)
        return max(1, min(base, self.core.args.max_num_batched_tokens))

    def _propose_drafts(self) -> None:
        """Ask the drafter for each decoding request's next drafts (``Request.draft_tokens``).
        Penalties apply per output position in a verify (each row counts the drafts before
        it), so requests with penalties draft too."""
        reqs = self._decoding()
        self._budget_drafts(reqs, self._draft(reqs), set())

    def _propose_cohort(self, pipeline: VerifyPipeline) -> set[Request]:
        """Pipelined: drafts for this step's cohort, the ready requests up to half of all
        drafting ones (``VerifyPipeline.cohort``); returns the requests held out of the step:
        those with a sample in flight (the other cohort; their next drafts need it) and the
        ready ones past the cohort. Requests with structured outputs never draft and are
        never held."""
        busy = [r for r in self.core.scheduler.running if r.num_pending and r.grammar is None]
        ready = self._decoding()
        take = pipeline.cohort(len(busy), len(ready))
        cohort = ready[:take]
        hold = {*busy, *ready[take:]}
        self._budget_drafts(cohort, self._draft(cohort), hold)
        return hold

    def _budget_drafts(self, reqs: list[Request], room: list[int], hold: set[Request]) -> None:
        """With the adaptive budget, trim ``reqs``' drafts (``room``: how many each had room
        for) to this step's choice, ``hold`` sitting the step out (``AdaptiveBudget.choose``:
        a pipelined cohort's drafts must beat plain decoding of the held requests too)."""
        if self.budget is None:
            return
        able = [(r, k) for r, k in zip(reqs, room) if k > 0]
        kept = self.budget.choose([r for r, _ in able], self._base_tokens(hold),
                                  [k for _, k in able], others=len(hold))
        self.stats.budget_tokens += sum(kept)
        if self.budget.last_priced is not None:
            tokens, seconds = self.budget.last_priced
            self.stats.chosen_steps += 1
            self.stats.expected_tokens += tokens
            self.stats.priced_seconds += seconds

    def _draft(self, reqs: list[Request]) -> list[int]:
        """``reqs``' drafts from the drafter (every other running request's cleared); returns
        how many drafts each had room for."""
        for r in self.core.scheduler.running:
            r.draft_tokens = []
        room = self._draft_room(reqs)
        t0 = time.perf_counter()
        for r, drafts in zip(reqs, self.drafter.propose(reqs, room)):
            r.draft_tokens = drafts
        self.stats.draft_seconds += time.perf_counter() - t0
        return room

    def _shadow_round(self) -> None:
        """Coasting (``speculative.adaptive``): shadow proposals that learn acceptance
        unverified."""
        def candidates() -> tuple[list[Request], list[int]]:
            reqs = self._generating()
            return reqs, self._draft_room(reqs)

        assert self.budget is not None  # coasting is the adaptive budget's
        t0 = time.perf_counter()
        self.budget.shadow_round(self.drafter, candidates)
        spent = time.perf_counter() - t0
        self.budget.add_shadow_time(spent)
        self.stats.draft_seconds += spent
        self.stats.coast_steps += 1


class SpeculationAccess:
    """Speculative decoding as callers of the engine core see it (``EngineCore``)."""

    speculation: Speculation | None

    @property
    def spec_stats(self) -> SpecStats | None:
        return self.speculation.stats if self.speculation is not None else None

    @property
    def drafter(self) -> Drafter | None:
        """The drafter proposing drafts (None without speculative decoding)."""
        return self.speculation.drafter if self.speculation is not None else None

    @property
    def budget(self) -> AdaptiveBudget | None:
        """The adaptive draft budget (None unless ``speculative_config`` asks for it)."""
        return self.speculation.budget if self.speculation is not None else None

    def use_drafter(self, drafter: Drafter) -> None:
        """Propose drafts with ``drafter`` from the next step on (``Speculation.use``)."""
        if self.speculation is None:
            raise ValueError("use_drafter needs speculative decoding on "
                             "(EngineArgs.speculative_config)")
        self.speculation.use(drafter)
