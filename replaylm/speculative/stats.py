"""Speculative decoding counters (``LLM.spec_stats()``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar


@dataclass
class SpecStats:
    #: Fields that are settings, not counters (data-parallel ranks share them; the rest sum).
    SETTINGS: ClassVar[tuple[str, ...]] = ("num_speculative_tokens", "budget", "verify")

    @classmethod
    def summed(cls, parts: Sequence[SpecStats]) -> SpecStats | None:
        """Several engines' counters added up (data-parallel ranks); None for no parts."""
        if not parts:
            return None
        total = replace(parts[0])
        for f in fields(cls):
            if f.name not in cls.SETTINGS:
                setattr(total, f.name, sum(getattr(p, f.name) for p in parts))
        return total

    num_speculative_tokens: int = 0  # the budget: most drafts a request verifies per step
    budget: str = "fixed"
    verify: str = "ragged"  # the verify layout (``SpecConfig.verify``)
    steps: int = 0  # steps launched with speculation on
    verify_steps: int = 0  # steps in which at least one request verified drafts
    verifies: int = 0  # (request, step) pairs that verified at least one draft
    draft_tokens: int = 0  # drafts verified
    accepted_tokens: int = 0  # drafts accepted
    verify_step_tokens: int = 0  # real tokens of verify steps
    verify_step_padded_tokens: int = 0  # the same steps' tokens as run (padded to a tier)
    layout_pad_tokens: int = 0  # of those, rows the ``padded`` layout added inside requests
    rejections: int = 0  # verifies that ended at a rejected draft (the rest accepted all)
    budget_tokens: int = 0  # adaptive budget: draft tokens it allowed, summed over steps
    draft_seconds: float = 0.0  # wall time of the drafter's proposals (a draft model's steps)
    draft_forwards: int = 0  # draft model steps run (catch-up and draft steps)
    coast_steps: int = 0  # adaptive budget: plain overlapped steps run while it does not pay
    pipelined_steps: int = 0  # verify steps left in flight while the next cohort's was built
    # What the adaptive budget expected of the verify steps it chose drafts for: the tokens
    # they emit and their price (``AdaptiveBudget.last_priced``), and what verify steps did:
    # the wall time of those measured (end of the previous step to the end of theirs) and
    # the tokens emitted by the verify steps resolved in them.
    chosen_steps: int = 0
    expected_tokens: float = 0.0
    priced_seconds: float = 0.0
    measured_steps: int = 0
    measured_tokens: int = 0
    measured_seconds: float = 0.0

    def record_launch(self, scheduled: Sequence[Any], real: int, padded: int,
                      layout_pad: int = 0) -> None:
        """A launched step of ``real`` scheduled tokens run as ``padded`` tokens, of which
        ``layout_pad`` are the padded verify layout's rows."""
        self.steps += 1
        drafts = sum(len(s.drafts) for s in scheduled)
        if not drafts:
            return
        self.verify_steps += 1
        self.verifies += sum(1 for s in scheduled if s.drafts)
        self.draft_tokens += drafts
        self.verify_step_tokens += real
        self.verify_step_padded_tokens += padded
        self.layout_pad_tokens += layout_pad

    def record_resolve(self, scheduled: Sequence[Any], sampled: Sequence[int]
                       ) -> list[tuple[Any, int, int]]:
        """Count accepted drafts: emitted rows past the first (non-emitted rows hold -1).
        Returns ``(request, drafts, accepted)`` for each request that verified drafts."""
        row, verified = 0, []
        for s in scheduled:
            if not s.sample:
                continue
            k = len(s.drafts)
            if k:
                a = sum(1 for t in sampled[row + 1: row + k + 1] if t >= 0)
                self.accepted_tokens += a
                self.rejections += a < k
                verified.append((s.request, k, a))
            row += k + 1
        return verified

    def as_dict(self) -> dict:
        v = max(1, self.verify_steps)
        return {
            "num_speculative_tokens": self.num_speculative_tokens,
            "budget": self.budget,
            "verify": self.verify,
            "steps": self.steps,
            "verify_steps": self.verify_steps,
            "mean_accepted_length": self.accepted_tokens / max(1, self.verifies),
            "acceptance_rate": self.accepted_tokens / max(1, self.draft_tokens),
            # Per draft token, given the drafts before it were accepted: accepted ÷ (accepted
            # + rejected) drafts (drafts after a rejection are never tried).
            "per_token_acceptance": self.accepted_tokens
            / max(1, self.accepted_tokens + self.rejections),
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "draft_tokens_per_step": self.draft_tokens / v,
            "verify_tokens_per_step": self.verify_step_tokens / v,
            "budget_tokens_per_step": self.budget_tokens / max(1, self.steps)
            if self.budget == "adaptive" else self.num_speculative_tokens,
            "draft_ms_per_step": 1000 * self.draft_seconds / max(1, self.steps),
            "draft_forwards_per_step": self.draft_forwards / max(1, self.steps),
            "coast_steps": self.coast_steps,
            "pipelined_steps": self.pipelined_steps,
            "padded_waste": 1 - self.verify_step_tokens / self.verify_step_padded_tokens
            if self.verify_step_padded_tokens else 0.0,
            "verify_step_tokens": self.verify_step_tokens,
            "verify_step_padded_tokens": self.verify_step_padded_tokens,
            "layout_pad_tokens": self.layout_pad_tokens,
            "rejections": self.rejections,
            "expected_tokens_per_verify": self.expected_tokens / max(1, self.chosen_steps),
            "priced_ms_per_verify": 1000 * self.priced_seconds / max(1, self.chosen_steps),
            "measured_tokens_per_verify": self.measured_tokens / max(1, self.measured_steps),
            "measured_ms_per_verify": 1000 * self.measured_seconds
            / max(1, self.measured_steps),
        }
