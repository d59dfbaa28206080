"""The drafters of ``bench spec``, whose acceptance is known in advance: none
(:class:`NoDrafter`), random drafts of lengths drawn from a distribution
(:class:`LengthDrafter`, part (a)), and a drafter of recorded greedy continuations whose
drafts the verify accepts with a set probability (:class:`ControlledDrafter`, part (b))."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from replaylm.speculative.protocol import DraftRequest

SKEW_SHORT = 0.8  # skewed drafts: this share draws a length in 0..2, the rest K


class NoDrafter:
    """Proposes nothing (requests decode plainly)."""

    def propose(self, requests: Sequence[DraftRequest], max_lens: Sequence[int]
                ) -> list[list[int]]:
        return [[] for _ in requests]


class LengthDrafter:
    """Random draft tokens of lengths drawn from a distribution (``uniform`` over 0..K, or
    ``skewed``: 0..2 with probability ``SKEW_SHORT``, else K)."""

    def __init__(self, distribution: str, k: int, vocab_size: int, seed: int) -> None:
        self.distribution, self.k, self.vocab = distribution, k, vocab_size
        self.rng = np.random.default_rng(seed)

    def length(self) -> int:
        if self.distribution == "uniform":
            return int(self.rng.integers(0, self.k + 1))
        if self.rng.random() < SKEW_SHORT:
            return int(self.rng.integers(0, min(2, self.k) + 1))
        return self.k

    def propose(self, requests: Sequence[DraftRequest], max_lens: Sequence[int]
                ) -> list[list[int]]:
        return [self.rng.integers(0, self.vocab, min(self.length(), m)).tolist()
                for _, m in zip(requests, max_lens)]


class ControlledDrafter:
    """Drafts each request's recorded greedy continuation (``references``: prompt -> output
    of a plain greedy run), every draft token replaced by another token with probability
    ``1 - p``, and decides which drafts the verify accepts (``acceptance``): the drafts it
    left right, up to the first it corrupted.

    Acceptance is imposed rather than left to the target's argmax because bf16 numerics
    differ between batch shapes: a verify row's logits are not bit-equal to the decode
    step's that recorded the reference, and on random weights (near-flat logits) the
    argmax flips within a few tokens, after which the reference says nothing. So the verify
    step, the acceptance kernels, the KV rollback and the host's bookkeeping all run as in
    real speculative decoding, with a known acceptance process: each draft is accepted with
    probability ``p`` given the ones before it were. A request whose output left its
    reference (``diverged``) is drafted random tokens, with the same process.

    ``expected_accepted`` sums, over proposals, the accepted length they imply
    (``p + p² + … + pᵏ``); divided by ``proposals`` it is the mean accepted length to expect
    when no budget trims the drafts.
    """

    def __init__(self, references: dict[tuple[int, ...], list[int]], p: float,
                 vocab_size: int, seed: int) -> None:
        self.refs, self.p, self.vocab = references, p, vocab_size
        self.rng = np.random.default_rng(seed)
        self.diverged: set[tuple[int, ...]] = set()
        self.right: dict[int, list[bool]] = {}  # id(request) -> its latest drafts' marks
        self.proposals = 0
        self.expected_accepted = 0.0

    def propose(self, requests: Sequence[Any], max_lens: Sequence[int]) -> list[list[int]]:
        # One draw of every request's randomness: this runs on the host every step.
        n, k = len(requests), max(max_lens, default=0)
        if not n or k < 1:
            return [[] for _ in requests]
        right = (self.rng.random((n, k)) < self.p).tolist()
        shift = self.rng.integers(1, self.vocab, (n, k)).tolist()
        noise = self.rng.integers(0, self.vocab, (n, k)).tolist()
        return [self._draft(r, m, right[i], shift[i], noise[i])
                for i, (r, m) in enumerate(zip(requests, max_lens))]

    def _draft(self, req: Any, k: int, right: list[bool], shift: list[int],
               noise: list[int]) -> list[int]:
        key = tuple(req.prompt_token_ids)
        ref = self.refs.get(key)
        out = req.output_token_ids
        if ref is None or k < 1:
            return []
        if key not in self.diverged and ref[:len(out)] != out:
            self.diverged.add(key)
        draft = noise[:k] if key in self.diverged else ref[len(out): len(out) + k]
        if not draft:
            return []
        right = right[:len(draft)]
        vocab = self.vocab
        draft = [d if ok else (d + s) % vocab for d, ok, s in zip(draft, right, shift)]
        self.right[id(req)] = right
        self.proposals += 1
        self.expected_accepted += sum(self.p ** j for j in range(1, len(draft) + 1))
        return draft

    @property
    def expected_accepted_length(self) -> float | None:
        return self.expected_accepted / self.proposals if self.proposals else None

    def shadow_accepted(self, req: Any, drafts: list[int], actual: list[int]) -> int:
        """How many of a shadow proposal's drafts the verify would have accepted (the
        adaptive budget's coasting, ``speculative.adaptive``): the leading ones left right."""
        right = self.right[id(req)][:len(drafts)]
        return right.index(False) if False in right else len(right)

    def acceptance(self, out: Any, state: Any) -> Any:
        """``ModelRunner.verify_accept``: each draft row's token becomes its draft when the
        draft was left right, and anything but its draft otherwise (all on the device)."""
        rows: list[int] = []
        drafts: list[int] = []
        right: list[bool] = []
        row = 0
        for s in out.scheduled:
            if not s.sample:
                continue
            k = len(s.drafts)
            if k:
                rows += range(row, row + k)
                drafts += s.drafts
                right += list(self.right[id(s.request)][:k])
            row += k + 1
        if not rows:
            return None
        vocab = self.vocab

        def accept(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
            # One copy from pinned memory: the driver may make a pageable one wait for the
            # stream (the forward just launched, and with pipelined verify steps the one
            # before it).
            staged = torch.tensor([rows, drafts, right], dtype=torch.int64)
            if tokens.is_cuda:
                staged = staged.pin_memory()
            rows_t, drafts_t, right_t = staged.to(tokens.device, non_blocking=True)
            drafts_t, right_t = drafts_t.to(tokens.dtype), right_t.bool()
            wrong = (drafts_t + 1) % vocab
            sampled = tokens.index_select(0, rows_t)
            new = torch.where(right_t, drafts_t,
                              torch.where(sampled == drafts_t, wrong, sampled))
            return tokens.index_copy(0, rows_t, new)

        return accept
