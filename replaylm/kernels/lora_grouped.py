"""The LoRA shrink and expand at many rows, grouped by adapter slot (SGMV-style).

``kernels.lora``'s kernels take a program per row (BGMV): each reads its slot's ``A`` or
``B`` tile for that row alone, so at 64 rows over 4 adapters every tile is read 16 times.
Here a program takes one slot (and one ``K`` range of a segment, or one block of output
columns) and one block of ``BLOCK_T`` rows, and multiplies that block's rows on its slot with
one ``tl.dot``, so each tile is read once per slot and row block. The row blocks are a grid
axis: a decode step's blocks run side by side, each program with one chain of loads (its
tile, and its block's slot indices, before the PDL wait; the rows and the shrink's partial
sums, all at once, after it), as long as the launch stays within ``GRID_TARGET`` programs;
past that (a wide output's expand, a long prefill) each program takes an even share of the
blocks in turn. The rows are not sorted: a program checks its
block's slot indices and skips a block holding none of its rows; a row is read and written
only by its own slot's programs (no atomics, so a replay and its eager run agree to the bit).

The layouts and roundings are ``kernels.lora``'s: the shrink writes fp32 partial sums
``[T, splits, S*R]`` over the same ``K`` ranges, the expand adds them in range order, rounds
the shrink to the model dtype, and adds ``scale * s @ B^T``, rounded, to the output in place.
Only the products' order of summation differs (a ``tl.dot`` per block). The shrink reads its
input rows as they are (the plain prologue): above ``skinny.MAX_M`` rows the projections run
unfused, so the separate norm or SiLU·mul has made them (``kernels.ops``). The torch
references are ``ref.lora_shrink`` and ``ref.lora_expand``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replaylm.kernels import pdl
from replaylm.kernels.dot import dot
from replaylm.kernels.pdl import wait_for_previous

#: Rows per block; ``tl.dot`` takes at least 16.
BLOCK_T = 16
#: Output columns per expand program.
BLOCK_N = 128
#: Programs a launch aims for. The row blocks run side by side (a program each) while
#: slots x (segments x K ranges, or column blocks) x row programs stays within it; past it
#: each program takes several blocks in turn, reading its adapter tile once for all of them
#: (always at least one program per slot and range or column block).
GRID_TARGET = 512


@triton.jit
def _row_block(slots_ptr, num_rows, slot, block, BLOCK_T: tl.constexpr):
    """Row block ``block`` (``BLOCK_T`` rows): its row indices, and which rows are on
    ``slot``."""
    t = (block * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    mine = tl.load(slots_ptr + t, mask=t < num_rows, other=-1) == slot
    return t, mine


@triton.jit(do_not_specialize=["num_rows", "in_dim", "row_steps"])
def _grouped_shrink_kernel(x_ptr, a_ptr, p_ptr, slots_ptr, ranks_ptr, num_rows, in_dim,
                           row_steps, stride_x, stride_al, stride_ar, stride_pt, stride_ps,
                           R: tl.constexpr, BLOCK_R: tl.constexpr, RANGE_K: tl.constexpr,
                           SPLITS: tl.constexpr, BLOCK_T: tl.constexpr, USE_PDL: tl.constexpr):
    slot = tl.program_id(0)
    seg = tl.program_id(2) // SPLITS
    split = tl.program_id(2) % SPLITS
    # Before the wait: the first row block's slots (copied in before the step's first
    # kernel), the slot's rank and its A tile (written between steps only).
    block = tl.program_id(1) * row_steps
    t, mine = _row_block(slots_ptr, num_rows, slot, block, BLOCK_T)
    rank = tl.load(ranks_ptr + slot)
    r = tl.arange(0, BLOCK_R)
    r_ok = r < rank
    k = split * RANGE_K + tl.arange(0, RANGE_K)
    k_ok = k < in_dim
    av = tl.load(a_ptr + slot * stride_al + (seg * R + r)[:, None] * stride_ar + k[None, :],
                 mask=r_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_R, RANGE_K]
    wait_for_previous(USE_PDL)
    if rank > 0:
        for i in range(row_steps):
            if i > 0:
                t, mine = _row_block(slots_ptr, num_rows, slot, block + i, BLOCK_T)
            if tl.max(mine.to(tl.int32), axis=0) > 0:
                xv = tl.load(x_ptr + t[:, None] * stride_x + k[None, :],
                             mask=mine[:, None] & k_ok[None, :], other=0.0)
                part = dot(xv, tl.trans(av))  # [BLOCK_T, BLOCK_R], fp32
                tl.store(p_ptr + t[:, None] * stride_pt + split * stride_ps + seg * R
                         + r[None, :], part, mask=mine[:, None] & r_ok[None, :])


@triton.jit(do_not_specialize=["num_rows", "row_steps", "out_dim", "seg1", "seg2"])
def _grouped_expand_kernel(y_ptr, p_ptr, b_ptr, ranks_ptr, scales_ptr, slots_ptr, num_rows,
                           row_steps, out_dim, seg1, seg2, stride_y, stride_pt, stride_ps,
                           stride_bl, stride_bn, R: tl.constexpr, NUM_SEG: tl.constexpr,
                           SPLITS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_T: tl.constexpr, USE_PDL: tl.constexpr):
    slot = tl.program_id(0)
    n_lo = tl.program_id(2) * BLOCK_N
    n = n_lo + tl.arange(0, BLOCK_N)
    n_ok = n < out_dim
    # Before the wait, as in the shrink: the first row block's slots, rank, scale, B rows.
    block = tl.program_id(1) * row_steps
    t, mine = _row_block(slots_ptr, num_rows, slot, block, BLOCK_T)
    rank = tl.load(ranks_ptr + slot)
    scale = tl.load(scales_ptr + slot)
    r = tl.arange(0, BLOCK_R)
    r_ok = r < rank
    bv = tl.load(b_ptr + slot * stride_bl + n[:, None] * stride_bn + r[None, :],
                 mask=n_ok[:, None] & r_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_R]
    wait_for_previous(USE_PDL)
    if rank > 0:
        dt = y_ptr.dtype.element_ty
        seg = (n >= seg1).to(tl.int32) + (n >= seg2).to(tl.int32)  # output segment of n
        n_hi = tl.minimum(n_lo + BLOCK_N, out_dim) - 1
        seg_lo = (n_lo >= seg1).to(tl.int32) + (n_lo >= seg2).to(tl.int32)
        seg_hi = (n_hi >= seg1).to(tl.int32) + (n_hi >= seg2).to(tl.int32)
        for i in range(row_steps):
            if i > 0:
                t, mine = _row_block(slots_ptr, num_rows, slot, block + i, BLOCK_T)
            if tl.max(mine.to(tl.int32), axis=0) > 0:
                ptrs = y_ptr + t[:, None] * stride_y + n[None, :]
                ok = mine[:, None] & n_ok[None, :]
                y = tl.load(ptrs, mask=ok)
                delta = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
                for j in tl.static_range(NUM_SEG):
                    if (seg_lo <= j) & (j <= seg_hi):  # the block has columns of segment j
                        # Segment j's shrink: its ranges' partial sums in range order,
                        # rounded to the model dtype as a separate LoRA branch stores it.
                        s_ptrs = p_ptr + t[:, None] * stride_pt + j * R + r[None, :]
                        sj = tl.zeros([BLOCK_T, BLOCK_R], dtype=tl.float32)
                        for sp in tl.static_range(SPLITS):
                            sj += tl.load(s_ptrs + sp * stride_ps,
                                          mask=mine[:, None] & r_ok[None, :], other=0.0)
                        part = dot(sj.to(dt), tl.trans(bv))  # [BLOCK_T, BLOCK_N], fp32
                        delta += tl.where((seg == j)[None, :], part, 0.0)
                # The delta is rounded to y's dtype before the add, as ``lora_expand``'s.
                delta = (delta.to(dt).to(tl.float32) * scale).to(dt)
                tl.store(ptrs, y + delta, mask=ok)


def _row_programs(num_rows: int, others: int) -> tuple[int, int]:
    """Programs along the rows, beside ``others`` programs on the other grid axes, and the
    row blocks each takes in turn: a block each while the grid stays within
    ``GRID_TARGET``, else an even share."""
    blocks = triton.cdiv(num_rows, BLOCK_T)
    steps = triton.cdiv(blocks, max(1, GRID_TARGET // others))
    return triton.cdiv(blocks, steps), steps


def _block_r(rank: int) -> int:
    return max(16, triton.next_power_of_2(rank))


def grouped_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor, ranks: torch.Tensor,
                   num_segments: int, range_k: int) -> torch.Tensor:
    """``kernels.lora.lora_shrink`` of plain input rows ``x`` ``[T, in]``, grouped by slot:
    fp32 partial sums ``[T, splits, S*R]`` over ``range_k``-wide ranges of ``K``."""
    t, in_dim = x.shape
    width = a.shape[1]
    rank = width // num_segments
    splits = triton.cdiv(in_dim, range_k)
    out = torch.empty(t, splits, width, dtype=torch.float32, device=x.device)
    if t == 0:
        return out
    row_programs, row_steps = _row_programs(t, a.shape[0] * num_segments * splits)
    _grouped_shrink_kernel[(a.shape[0], row_programs, num_segments * splits)](
        x, a, out, slots, ranks, t, in_dim, row_steps, x.stride(0), a.stride(0), a.stride(1),
        out.stride(0), out.stride(1), R=rank, BLOCK_R=_block_r(rank), RANGE_K=range_k,
        SPLITS=splits, BLOCK_T=BLOCK_T, USE_PDL=pdl.ENABLED, num_warps=4, **pdl.LAUNCH,
    )
    return out


def grouped_expand(y: torch.Tensor, s: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                   ranks: torch.Tensor, scales: torch.Tensor, num_segments: int, seg1: int,
                   seg2: int) -> torch.Tensor:
    """``kernels.lora.lora_expand`` grouped by slot: ``y`` plus each row's delta from the
    shrink's partial sums ``s``, in place; returns ``y``. ``seg1``, ``seg2``: the first
    columns of the second and third output segments (``lora.segment_bounds``)."""
    t, out_dim = y.shape
    rank = b.shape[2]
    if t == 0:
        return y
    row_programs, row_steps = _row_programs(t, b.shape[0] * triton.cdiv(out_dim, BLOCK_N))
    _grouped_expand_kernel[(b.shape[0], row_programs, triton.cdiv(out_dim, BLOCK_N))](
        y, s, b, ranks, scales, slots, t, row_steps, out_dim, seg1, seg2, y.stride(0), s.stride(0),
        s.stride(1), b.stride(0), b.stride(1), R=rank, NUM_SEG=num_segments,
        SPLITS=s.shape[1], BLOCK_R=_block_r(rank), BLOCK_N=BLOCK_N, BLOCK_T=BLOCK_T,
        USE_PDL=pdl.ENABLED, num_warps=4, **pdl.LAUNCH,
    )
    return y
