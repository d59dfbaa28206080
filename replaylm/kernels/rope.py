"""Per-head RMSNorm (Qwen3's q/k norm) and neox rotary, as a Triton helper shared by the
rotary kernel (``elementwise.rotary``) and decode attention that rotates its own q and new
key (``attention.paged_attention(rope=...)``), so both round exactly as the torch path
does."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True, kw_only=True)
class RotaryArgs:
    """The rotary kernel's inputs besides the tensors it rotates, shared by the launches that
    do its work themselves: neox rotary at ``positions`` (``cos_sin``: the fp32
    ``[max_pos, D]`` table of ``model.config.rope_cos_sin``), Qwen3's q/k norm when the
    norm weights are given, and the KV-cache write at ``slot_mapping`` (slot < 0 skips)."""

    positions: torch.Tensor
    cos_sin: torch.Tensor
    slot_mapping: torch.Tensor
    q_norm_weight: torch.Tensor | None = None
    k_norm_weight: torch.Tensor | None = None
    eps: float = 1e-6


@triton.jit
def norm_rope(x1, x2, w1, w2, cos, sin, eps, HALF: tl.constexpr, HAS_NORM: tl.constexpr):
    """Rotate heads given as halves ``x1``/``x2`` ``[R, HALF]`` (model dtype), optionally
    RMS-normalising each row first with weight halves ``w1``/``w2`` (fp32 ``[HALF]``).
    ``cos``/``sin`` are fp32, already rounded to the model dtype, ``[1, HALF]`` (one position
    for every row) or ``[R, HALF]`` (a position per row). Returns the rotated halves in the
    model dtype. Intermediates are rounded where transformers' modules round them: the
    normalised value, its product with the weight, each rotary product."""
    dt = x1.dtype
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    if HAS_NORM:
        rstd = tl.rsqrt((tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)) / (2 * HALF) + eps)
        a = ((a * rstd[:, None]).to(dt).to(tl.float32) * w1[None, :]).to(dt).to(tl.float32)
        b = ((b * rstd[:, None]).to(dt).to(tl.float32) * w2[None, :]).to(dt).to(tl.float32)
    o1 = (a * cos).to(dt).to(tl.float32) - (b * sin).to(dt).to(tl.float32)
    o2 = (b * cos).to(dt).to(tl.float32) + (a * sin).to(dt).to(tl.float32)
    return o1.to(dt), o2.to(dt)
