"""What the scheduler hands a step: each request's run of tokens, and the step's bookkeeping
(``engine.scheduler`` makes them; the runner, the core and speculation read them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from replaylm.engine.request import Request


@dataclass
class ScheduledRequest:
    """One request's share of a step: ``num_new_tokens`` tokens from position ``start``."""

    request: Request
    num_new_tokens: int
    start: int  # request.num_computed_tokens at schedule time
    sample: bool  # the run reaches the last known token, so the step samples one token
    # Speculative decoding: draft tokens verified after the last known token (they are the
    # run's last ``len(drafts)`` tokens); the step then samples ``len(drafts) + 1`` rows.
    drafts: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    """What one step runs, in front-packing order, plus the bookkeeping the runner needs."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    newly_slotted: list[Request] = field(default_factory=list)
    # Scheduling stopped early because the pool is full and the only preemption victims are
    # in flight: resolving the in-flight step first frees the way.
    blocked: bool = False

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_prefill_tokens(self) -> int:
        """Tokens of prompt chunks (and recomputes): runs of more than one known token. The
        rest of ``num_batched_tokens`` decodes (one token, or one plus its drafts)."""
        return sum(s.num_new_tokens for s in self.scheduled if s.num_new_tokens > 1 + len(s.drafts))

    @property
    def num_sampled(self) -> int:
        """Sampled rows: one per sampling request, ``k + 1`` for one verifying ``k`` drafts."""
        return sum(1 + len(s.drafts) for s in self.scheduled if s.sample)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
