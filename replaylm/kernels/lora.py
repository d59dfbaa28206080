"""Multi-adapter LoRA kernels: every row of a batch gathers its own adapter slot (BGMV-style).

A targeted projection's LoRA delta is ``y[t] += scale[l] * (x[t] @ A[l]^T) @ B[l]^T`` with
``l = slots[t]``. The adapter weights live in per-slot static buffers (``replaylm.lora``):
``A`` ``[L, S*R, in]`` (``S`` output segments — q, k, v of a fused qkv — each with ``R`` rank
rows, ``R`` = ``max_lora_rank``) and ``B`` ``[L, out, R]``. Two launches per projection:

* :func:`lora_shrink` — program ``(t, segment, rank block)`` computes ``BLOCK_R`` rank rows
  of ``x[t] @ A[l, seg]^T`` over the adapter's own rank (``ranks[l]``; blocks past it return
  at once), accumulating in fp32. Splitting the rank over programs keeps a batch-1 step's
  shrink on several SMs instead of one;
* :func:`lora_expand` — program ``(t, column block)`` adds ``scale * s[t, seg(n)] @
  B[l, n]^T`` to the projection's output in place.

A row whose slot is -1 (a base-model request, or padding) or whose slot is empty (rank 0)
returns at once: it reads no weight and writes nothing. Slot, rank and scale are read on the
device, so one captured graph serves every mix of adapters. The torch references are
``kernels.ref.lora_shrink`` / ``lora_expand``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Rank rows one shrink program computes.
SHRINK_ROWS = 4


@triton.jit(do_not_specialize=["in_dim"])
def _shrink_kernel(x_ptr, a_ptr, s_ptr, slots_ptr, ranks_ptr, in_dim, stride_x, stride_al,
                   stride_ar, stride_s, R: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    seg = tl.program_id(1)
    r0 = tl.program_id(2) * BLOCK_R
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot >= 0:
        rank = tl.load(ranks_ptr + slot)
        if r0 < rank:
            r = r0 + tl.arange(0, BLOCK_R)
            r_ok = r < rank
            a_rows = a_ptr + slot * stride_al + (seg * R + r)[:, None] * stride_ar
            acc = tl.zeros([BLOCK_R], dtype=tl.float32)
            for k0 in range(0, in_dim, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                k_ok = k < in_dim
                xv = tl.load(x_ptr + row * stride_x + k, mask=k_ok, other=0.0).to(tl.float32)
                av = tl.load(a_rows + k[None, :], mask=r_ok[:, None] & k_ok[None, :],
                             other=0.0).to(tl.float32)
                acc += tl.sum(av * xv[None, :], axis=1)
            tl.store(s_ptr + row * stride_s + seg * R + r,
                     acc.to(s_ptr.dtype.element_ty), mask=r_ok)


@triton.jit(do_not_specialize=["out_dim", "seg1", "seg2"])
def _expand_kernel(y_ptr, s_ptr, b_ptr, slots_ptr, ranks_ptr, scales_ptr, out_dim, seg1, seg2,
                   stride_y, stride_s, stride_bl, stride_bn, R: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot >= 0:
        rank = tl.load(ranks_ptr + slot)
        if rank > 0:
            n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = n < out_dim
            seg = (n >= seg1).to(tl.int32) + (n >= seg2).to(tl.int32)  # output segment of n
            r = tl.arange(0, BLOCK_R)
            ok = n_ok[:, None] & (r < rank)[None, :]
            sv = tl.load(s_ptr + row * stride_s + (seg * R)[:, None] + r[None, :], mask=ok,
                         other=0.0).to(tl.float32)
            bv = tl.load(b_ptr + slot * stride_bl + n[:, None] * stride_bn + r[None, :],
                         mask=ok, other=0.0).to(tl.float32)
            delta = tl.sum(sv * bv, axis=1)
            # The delta is rounded to y's dtype before the add, as a separate LoRA branch is.
            delta = (delta.to(y_ptr.dtype.element_ty).to(tl.float32)
                     * tl.load(scales_ptr + slot)).to(y_ptr.dtype.element_ty)
            y = tl.load(y_ptr + row * stride_y + n, mask=n_ok)
            tl.store(y_ptr + row * stride_y + n, y + delta, mask=n_ok)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor,
                ranks: torch.Tensor, num_segments: int = 1) -> torch.Tensor:
    """``x[t] @ a[slots[t]]^T`` per row (``ref.lora_shrink``), one program per (row, output
    segment); rows without an adapter are left unwritten (``lora_expand`` never reads them).
    Each segment's rows are read up to the slot's rank only."""
    t, in_dim = x.shape
    _, width, a_in = a.shape
    assert a_in == in_dim and x.stride(1) == 1 and a.stride(2) == 1
    assert width % num_segments == 0
    rank = width // num_segments
    out = x.new_empty(t, width)
    if t == 0:
        return out
    block_r = min(SHRINK_ROWS, triton.next_power_of_2(rank))
    _shrink_kernel[(t, num_segments, triton.cdiv(rank, block_r))](
        x, a, out, slots, ranks, in_dim, x.stride(0), a.stride(0), a.stride(1), out.stride(0),
        R=rank, BLOCK_R=block_r, BLOCK_K=min(512, triton.next_power_of_2(in_dim)), num_warps=4,
    )
    return out


def lora_expand(y: torch.Tensor, s: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                ranks: torch.Tensor, scales: torch.Tensor,
                segments: tuple[int, ...]) -> torch.Tensor:
    """``y[t] += scales[l] * s[t, seg] @ b[l, seg]^T`` per output segment, ``l = slots[t]``
    (``ref.lora_expand``), in place; returns ``y``. At most three segments (q, k, v)."""
    t, out_dim = y.shape
    assert b.shape[1] == out_dim == sum(segments) and 1 <= len(segments) <= 3
    assert y.stride(1) == 1 and s.stride(1) == 1 and b.stride(2) == 1
    rank = b.shape[2]
    if t == 0:
        return y
    bounds = [sum(segments[: j + 1]) for j in range(len(segments) - 1)]
    seg1, seg2 = (bounds + [out_dim, out_dim])[:2]
    block_n = min(128, triton.next_power_of_2(out_dim))
    _expand_kernel[(t, triton.cdiv(out_dim, block_n))](
        y, s, b, slots, ranks, scales, out_dim, seg1, seg2, y.stride(0), s.stride(0),
        b.stride(0), b.stride(1), R=rank, BLOCK_R=triton.next_power_of_2(rank), BLOCK_N=block_n,
        num_warps=4,
    )
    return y

