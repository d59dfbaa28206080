"""Speculative decoding counters (``LLM.spec_stats()``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class SpecStats:
    num_speculative_tokens: int = 0  # the budget: most drafts a request verifies per step
    budget: str = "fixed"
    steps: int = 0  # steps launched with speculation on
    verify_steps: int = 0  # steps in which at least one request verified drafts
    verifies: int = 0  # (request, step) pairs that verified at least one draft
    draft_tokens: int = 0  # drafts verified
    accepted_tokens: int = 0  # drafts accepted
    verify_step_tokens: int = 0  # real tokens of verify steps
    verify_step_padded_tokens: int = 0  # the same steps' tokens as run (padded to a tier)
    budget_tokens: int = 0  # adaptive budget: draft tokens it allowed, summed over steps
    draft_seconds: float = 0.0  # wall time of the drafter's proposals (a draft model's steps)
    draft_forwards: int = 0  # draft model steps run (catch-up and draft steps)

    def record_launch(self, scheduled: Sequence[Any], real: int, padded: int) -> None:
        self.steps += 1
        drafts = sum(len(s.drafts) for s in scheduled)
        if not drafts:
            return
        self.verify_steps += 1
        self.verifies += sum(1 for s in scheduled if s.drafts)
        self.draft_tokens += drafts
        self.verify_step_tokens += real
        self.verify_step_padded_tokens += padded

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
                verified.append((s.request, k, a))
            row += k + 1
        return verified

    def as_dict(self) -> dict:
        v = max(1, self.verify_steps)
        return {
            "num_speculative_tokens": self.num_speculative_tokens,
            "budget": self.budget,
            "steps": self.steps,
            "verify_steps": self.verify_steps,
            "mean_accepted_length": self.accepted_tokens / max(1, self.verifies),
            "acceptance_rate": self.accepted_tokens / max(1, self.draft_tokens),
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "draft_tokens_per_step": self.draft_tokens / v,
            "verify_tokens_per_step": self.verify_step_tokens / v,
            "budget_tokens_per_step": self.budget_tokens / max(1, self.steps)
            if self.budget == "adaptive" else self.num_speculative_tokens,
            "draft_ms_per_step": 1000 * self.draft_seconds / max(1, self.steps),
            "draft_forwards_per_step": self.draft_forwards / max(1, self.steps),
            "padded_waste": 1 - self.verify_step_tokens / self.verify_step_padded_tokens
            if self.verify_step_padded_tokens else 0.0,
        }
