"""Token bitmasks of structured outputs, applied to logits on the device (graph-safe).

A mask holds one bit per vocabulary entry, 32 to an int32 word (xgrammar's layout: bit
``v % 32`` of word ``v // 32`` set means token ``v`` is allowed). The graphs' static buffers
hold one mask row per request slot and one flag per slot (``graphs.buffers``); a row is applied
only where its slot's flag is 1, so rows of unconstrained requests (flag 0) keep their logits
bit for bit. Fixed shapes, no host sync: the same ops run inside a captured step and eagerly.
"""

from __future__ import annotations

import torch


def bitmask_words(vocab_size: int) -> int:
    """Int32 words per mask row: ``ceil(vocab_size / 32)``."""
    return (vocab_size + 31) // 32


_SHIFTS: dict[torch.device, torch.Tensor] = {}


def _shifts(device: torch.device) -> torch.Tensor:
    t = _SHIFTS.get(device)
    if t is None:
        t = torch.arange(32, dtype=torch.int32, device=device)
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if not capturing:  # built during a capture it would hold nothing: rebuild inline
            _SHIFTS[device] = t
    return t


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, flags: torch.Tensor,
                        slots: torch.Tensor) -> torch.Tensor:
    """Set to ``-inf``, in place, the logits of tokens the mask of each row's slot forbids.

    ``logits`` ``[L, V]``; ``bitmask`` ``[S+1, W]`` int32 per slot; ``flags`` ``[S+1]`` int32
    (1: the slot's request is constrained); ``slots`` ``[L]`` each row's slot. On CUDA one
    Triton launch (``replaylm.kernels.bitmask``); elsewhere this torch reference, its oracle.
    """
    n, vocab = logits.shape
    if n == 0:
        return logits
    if logits.is_cuda and logits.stride(-1) == 1:  # one launch, early exit per free row
        from replaylm.kernels.bitmask import apply_token_bitmask as kernel

        return kernel(logits, bitmask, flags, slots)
    words = bitmask.index_select(0, slots)  # [L, W]
    bits = torch.bitwise_right_shift(words.unsqueeze(-1), _shifts(logits.device)) & 1
    allowed = bits.view(n, -1)[:, :vocab].to(torch.bool)
    off = flags.index_select(0, slots) == 0  # unconstrained rows: every token allowed
    forbidden = ~(allowed | off.unsqueeze(-1))
    return logits.masked_fill_(forbidden, float("-inf"))
