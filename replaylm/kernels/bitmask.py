"""Structured outputs' token bitmask applied to logits rows in one launch (CUDA).

The torch reference (``replaylm.sampling.bitmask``) expands every row's mask to ``[L, V]``
whether or not its request is constrained: at a large tier and a 150k vocabulary that is
several hundred MB of traffic on every step, constrained or not. Here each program handles one
chunk of one row: it reads the row's slot flag and exits at once when the slot is
unconstrained (the common case costs a few loads per program), else sets the logits of the
tokens the slot's mask forbids to ``-inf``. Fixed grid, no host sync: graph-safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replaylm.kernels import pdl
from replaylm.kernels.pdl import wait_for_previous

CHUNK = 4096  # vocab entries per program


@triton.jit
def _bitmask_kernel(logits_ptr, stride_row, mask_ptr, stride_mask, flags_ptr, slots_ptr, vocab,
                    CHUNK: tl.constexpr, USE_PDL: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    wait_for_previous(USE_PDL)  # before any read and any early exit (``kernels.pdl``)
    slot = tl.load(slots_ptr + row)
    if tl.load(flags_ptr + slot) != 0:
        offs = chunk * CHUNK + tl.arange(0, CHUNK)
        inside = offs < vocab
        words = tl.load(mask_ptr + slot * stride_mask + offs // 32, mask=inside, other=-1)
        forbidden = ((words >> (offs % 32)) & 1) == 0
        ptrs = logits_ptr + row.to(tl.int64) * stride_row + offs
        neg = tl.full([CHUNK], float("-inf"), dtype=logits_ptr.dtype.element_ty)
        tl.store(ptrs, neg, mask=inside & forbidden)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, flags: torch.Tensor,
                        slots: torch.Tensor) -> torch.Tensor:
    """As ``sampling.bitmask.apply_token_bitmask``: in place on ``logits`` ``[L, V]``
    (contiguous last dim); ``bitmask`` ``[S+1, W]`` int32, ``flags`` ``[S+1]`` int32,
    ``slots`` ``[L]``."""
    rows, vocab = logits.shape
    if rows == 0:
        return logits
    assert logits.stride(-1) == 1 and bitmask.stride(-1) == 1 and bitmask.dtype == torch.int32
    assert slots.is_contiguous() and flags.is_contiguous()
    _bitmask_kernel[(rows, triton.cdiv(vocab, CHUNK))](
        logits, logits.stride(0), bitmask, bitmask.stride(0), flags, slots, vocab,
        CHUNK=CHUNK, USE_PDL=pdl.ENABLED, num_warps=4, **pdl.LAUNCH,
    )
    return logits
