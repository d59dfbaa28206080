"""Acceptance of draft tokens on the device (fixed shapes, no host sync).

A verify step samples every row of a request with drafts: row ``j`` (``j = 0..k``) holds
the target's logits after the request's context plus drafts ``0..j-1``, and is sampled
exactly as plain decoding samples output position ``j`` (same processing, same counter-based
random stream keyed by seed and output position). Draft ``j`` is accepted when it equals
row ``j``'s sample; the request emits rows ``0..a`` where ``a`` is the number of leading
accepted drafts: the accepted drafts and, after them, the bonus (or correcting) token.

For point proposals (n-gram drafts, and greedy requests of any drafter) this *is* exact
rejection sampling: drawing ``t ~ p`` and accepting draft ``d`` iff ``t == d`` accepts with
probability ``p(d)``, and on rejection ``t`` is distributed as ``p`` without ``d``,
renormalised, which is the residual ``max(p - q, 0)`` of the point mass ``q``. It also keeps
seeded requests on the very tokens plain decoding draws. ``rejection_sample`` is the general
rule for proposals with a distribution ``q`` (a draft model sampling at temperature > 0).
"""

from __future__ import annotations

import torch

from replaylm.kernels.counter_rng import row_keys, uniforms
from replaylm.sampling.sampler import draw

_ACCEPT_SALT = 0x5BD1E995  # separates the accept-test stream from the sampling streams


def emitted_rows(tokens: torch.Tensor, draft_next: torch.Tensor,
                 seg_start: torch.Tensor) -> torch.Tensor:
    """Which sampled rows a request emits: ``[L]`` bool.

    ``tokens`` ``[L]``: each row's sample. ``draft_next`` ``[L]``: the draft token row ``i``'s
    sample must equal for the request to go on to row ``i + 1`` (-1 on a request's last
    row). ``seg_start`` ``[L]``: the first row of each row's request. Row ``i`` is emitted
    iff every earlier row of its request matched its draft.
    """
    miss = (tokens != draft_next).to(torch.int64)
    before = torch.cumsum(miss, 0) - miss  # misses in rows before i (whole batch)
    return before == before.index_select(0, seg_start)


def rejection_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor,
                     draft_tokens: torch.Tensor, seed_keys: torch.Tensor,
                     out_pos: torch.Tensor, vocab_hash: torch.Tensor) -> tuple[torch.Tensor,
                                                                                 torch.Tensor]:
    """Speculative rejection sampling for one draft token per row.

    ``target_probs``, ``draft_probs`` ``[L, V]``: the target's and the proposal's
    distributions at each row; ``draft_tokens`` ``[L]``: the tokens drawn from the proposal.
    Draft ``d`` is accepted with probability ``min(1, p(d) / q(d))``; otherwise the row's
    token is drawn from ``max(p - q, 0)`` renormalised. Returns ``(accepted [L] bool, token
    [L])`` where ``token`` is the draft when accepted, else the residual draw; the result is
    distributed exactly as ``p``. Randomness is counter-based on ``(seed key, out_pos)``.
    """
    rows = torch.arange(len(draft_tokens), device=draft_tokens.device)
    p_d = target_probs[rows, draft_tokens]
    q_d = draft_probs[rows, draft_tokens]
    rkeys = row_keys(seed_keys ^ _ACCEPT_SALT, out_pos)
    u = uniforms(rkeys, vocab_hash[:1])[:, 0]
    accepted = u * q_d <= p_d  # u < p/q without dividing by a zero q
    residual = (target_probs - draft_probs).clamp_(min=0)
    # A row whose residual is all zero (p == q) is always accepted; keep its draw finite.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, target_probs)
    drawn = draw(residual, seed_keys, out_pos, vocab_hash)
    return accepted, torch.where(accepted, draft_tokens, drawn)
