"""Multi-adapter LoRA kernels: every row of a batch gathers its own adapter slot (BGMV-style).

A targeted projection's LoRA delta is ``y[t] += scale[l] * (u[t] @ A[l]^T) @ B[l]^T`` with
``l = slots[t]`` and ``u`` the projection's input rows. The adapter weights live in per-slot
static buffers (``replaylm.lora``): ``A`` ``[L, S*R, in]`` (``S`` output segments — q, k, v
of a fused qkv — each with ``R`` rank rows, ``R`` = ``max_lora_rank``) and ``B``
``[L, out, R]``.

The shrink computes ``u`` itself from what the base projection reads (its *prologue*), so
the base projection keeps its fused form (``kernels.skinny``'s RMSNorm prologue):
``PROLOGUE_NORM`` reads ``x + residual`` (the new residual, which the fused projection
stores; the shrink runs before it) and applies RMSNorm with the layer's norm weight (qkv,
gate_up), with the roundings of the separate ops (``ref.lora_input``); ``PROLOGUE_PLAIN``
reads ``u`` as it is (o and down, and qkv and gate_up after a separate norm).

* :func:`lora_shrink` — program ``(t, segment, K range)`` computes the prologue of its range
  of row ``t``'s input (RMSNorm reads the whole row once for its ``1 / rms``) and that range's
  share of ``u[t] @ A[l, seg]^T`` for every rank row of the slot, into fp32 partial sums
  ``[T, splits, S*R]``: a few wide ranges per row and segment (``shrink_split``), since each
  program loads its ``A`` tile before its PDL wait and every consumer adds all the ranges;
* :func:`lora_expand` — program ``(t, column block)`` adds each segment's partial sums in
  range order (deterministic: no atomics), rounds the shrink to the model dtype as a separate
  LoRA branch stores it, and adds ``scale * s[t, seg(n)] @ B[l, n]^T`` to the output in place.
  At a few rows ``kernels.ops`` instead folds this half into the skinny projection's
  epilogue (``kernels.skinny_lora``), where the projection runs a whole-K skinny tile.

Above ``GROUPED_ABOVE`` rows both take ``kernels.lora_grouped``'s kernels instead (the shrink
where its rows are plain, as they are there): a program per slot reads its ``A`` or ``B``
tile once for all of that slot's rows, with the same layouts and roundings.

:func:`lora_add` is the two launches in turn. A row whose slot is -1 (a base-model request,
or padding) or whose slot is empty (rank 0) reads no weight and its output row is left as it
is, to the bit. Slot, rank and scale are read on the device, so one captured graph serves
every mix of adapters. The kernels launch with PDL (``kernels.pdl``) and wait for the
previous kernel before anything else. The torch references are ``kernels.ref.lora_shrink`` /
``lora_expand`` / ``lora_add``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replaylm.kernels import pdl
from replaylm.kernels.lora_grouped import grouped_expand, grouped_shrink
from replaylm.kernels.pdl import release_after_wait, wait_for_previous
from replaylm.kernels.skinny import MAX_M

#: K ranges the shrink aims for per row and segment (``shrink_split``). The expand and the
#: folded projection add every range's partial sums, in registers, so fewer ranges cost them
#: less; on the H200 4 beat 8 and 32 for every group of the Llama 3.2 1B shape at one row
#: (``benchmarks/lora_kernels.py --shrink-ranges 32,8,4``).
SHRINK_RANGES = 4
#: Most ``A`` elements one shrink program holds (rank rows x range width).
SHRINK_TILE = 8192
#: What a kernel computes from its raw input before the shrink (``ref.lora_input``).
PROLOGUE_PLAIN, PROLOGUE_NORM = 0, 1
#: Above this many rows (where the projections run unfused) the shrink of plain rows and the
#: expand group the rows by slot (``kernels.lora_grouped``): each adapter tile is read once
#: per slot, not once per row.
GROUPED_ABOVE = MAX_M


@triton.jit
def _norm_rows(x_ptr, r_ptr, rows, k, ok, stride_x, stride_r, HAS_RESIDUAL: tl.constexpr):
    """``x + residual`` at ``rows`` x ``k`` (``x`` alone without one), rounded to the model
    dtype as the new residual is (``ref.add_rms_norm``)."""
    x = tl.load(x_ptr + rows[:, None] * stride_x + k[None, :], mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + rows[:, None] * stride_r + k[None, :], mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def _inv_rms(x_ptr, r_ptr, rows, row_ok, in_dim, stride_x, stride_r, eps,
             BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """``1 / rms`` of each of ``rows`` (``[BLOCK_M]``) of ``x + residual`` over ``in_dim``
    columns, in fp32."""
    sq = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, in_dim, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        ok = row_ok[:, None] & (k < in_dim)[None, :]
        v = _norm_rows(x_ptr, r_ptr, rows, k, ok, stride_x, stride_r,
                       HAS_RESIDUAL).to(tl.float32)
        sq += tl.sum(v * v, axis=1)
    return tl.rsqrt(sq / in_dim + eps)


@triton.jit
def _input_chunk(x_ptr, r_ptr, nw_ptr, rows, row_ok, inv_rms, k, in_dim, stride_x, stride_r,
                 PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """The shrink's input rows ``rows`` at columns ``k`` (``[BM, BK]``), in the model dtype,
    rounded as the separate ops round (``ref.lora_input``); 0 outside ``row_ok``."""
    k_ok = k < in_dim
    ok = row_ok[:, None] & k_ok[None, :]
    if PROLOGUE == 1:
        x = _norm_rows(x_ptr, r_ptr, rows, k, ok, stride_x, stride_r, HAS_RESIDUAL)
    else:
        x = tl.load(x_ptr + rows[:, None] * stride_x + k[None, :], mask=ok, other=0.0)
    dt = x.dtype
    if PROLOGUE == 1:  # RMSNorm: fp32, rounded, then times the weight (rounded again)
        w = tl.load(nw_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
        x = (x.to(tl.float32) * inv_rms[:, None]).to(dt)
        x = (x.to(tl.float32) * w[None, :]).to(dt)
    return tl.where(ok, x, 0.0).to(dt)


@triton.jit(do_not_specialize=["in_dim"])
def _shrink_kernel(x_ptr, r_ptr, nw_ptr, a_ptr, p_ptr, slots_ptr, ranks_ptr, in_dim, eps,
                   stride_x, stride_r, stride_al, stride_ar, stride_pt, stride_ps,
                   R: tl.constexpr, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                   BLOCK_R: tl.constexpr, RANGE_K: tl.constexpr, NORM_BLOCK: tl.constexpr,
                   USE_PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    seg = tl.program_id(1)
    split = tl.program_id(2)
    # Before the wait: the row's slot (copied in before the step's first kernel) and the
    # slot's rank and A tile (written between steps only), so that after it only the input
    # rows are read. A dead row (slot -1 or rank 0) loads nothing.
    slot = tl.load(slots_ptr + row).to(tl.int64)
    live_slot = tl.maximum(slot, 0)
    rank = tl.load(ranks_ptr + live_slot, mask=slot >= 0, other=0)
    r = tl.arange(0, BLOCK_R)
    r_ok = r < rank
    k = split * RANGE_K + tl.arange(0, RANGE_K)
    av = tl.load(a_ptr + live_slot * stride_al + (seg * R + r)[:, None] * stride_ar
                 + k[None, :], mask=r_ok[:, None] & (k < in_dim)[None, :], other=0.0)
    # Its dependents are scheduled only after this wait, so the projection after it may
    # read the rows this kernel reads before its own wait (``skinny_lora``).
    release_after_wait(USE_PDL)
    if rank > 0:
        rows = row + tl.zeros([1], dtype=tl.int64)  # this program's row, as a block
        row_ok = rows >= 0
        inv_rms = tl.full([1], 1.0, tl.float32)
        if PROLOGUE == 1:
            inv_rms = _inv_rms(x_ptr, r_ptr, rows, row_ok, in_dim, stride_x, stride_r,
                               eps, 1, NORM_BLOCK, HAS_RESIDUAL)
        xv = _input_chunk(x_ptr, r_ptr, nw_ptr, rows, row_ok, inv_rms, k, in_dim,
                          stride_x, stride_r, PROLOGUE,
                          HAS_RESIDUAL).to(tl.float32)  # [1, RANGE_K]
        tl.store(p_ptr + row * stride_pt + split * stride_ps + seg * R + r,
                 tl.sum(av.to(tl.float32) * xv, axis=1), mask=r_ok)


@triton.jit(do_not_specialize=["out_dim", "seg1", "seg2", "splits"])
def _expand_kernel(y_ptr, p_ptr, b_ptr, slots_ptr, ranks_ptr, scales_ptr, out_dim, seg1, seg2,
                   splits, stride_y, stride_pt, stride_ps, stride_bl, stride_bn,
                   R: tl.constexpr, NUM_SEG: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < out_dim
    # Before the wait, as in the shrink: slot, rank, scale and the B rows of the block.
    slot = tl.load(slots_ptr + row).to(tl.int64)
    live_slot = tl.maximum(slot, 0)
    rank = tl.load(ranks_ptr + live_slot, mask=slot >= 0, other=0)
    scale = tl.load(scales_ptr + live_slot, mask=slot >= 0, other=0.0)
    r = tl.arange(0, BLOCK_R)
    r_ok = r < rank
    bv = tl.load(b_ptr + live_slot * stride_bl + n[:, None] * stride_bn + r[None, :],
                 mask=n_ok[:, None] & r_ok[None, :], other=0.0).to(tl.float32)
    wait_for_previous(USE_PDL)
    if rank > 0:
        dt = y_ptr.dtype.element_ty
        seg = (n >= seg1).to(tl.int32) + (n >= seg2).to(tl.int32)  # output segment of n
        delta = tl.zeros([BLOCK_N], dtype=tl.float32)
        for j in tl.static_range(NUM_SEG):
            cols = n_ok & (seg == j)
            if tl.sum(cols.to(tl.int32)) > 0:
                # Segment j's shrink: its ranges' partial sums in range order, rounded to
                # the model dtype as a separate LoRA branch stores it.
                sj = tl.zeros([BLOCK_R], dtype=tl.float32)
                for sp in range(splits):
                    sj += tl.load(p_ptr + row * stride_pt + sp * stride_ps + j * R + r,
                                  mask=r_ok, other=0.0)
                sj = sj.to(dt).to(tl.float32)
                delta += tl.where(cols, tl.sum(bv * sj[None, :], axis=1), 0.0)
        # The delta is rounded to y's dtype before the add, as a separate LoRA branch is.
        delta = (delta.to(dt).to(tl.float32) * scale).to(dt)
        y = tl.load(y_ptr + row * stride_y + n, mask=n_ok)
        tl.store(y_ptr + row * stride_y + n, y + delta, mask=n_ok)


def _check(x: torch.Tensor, a: torch.Tensor, norm_weight: torch.Tensor | None,
           residual: torch.Tensor | None) -> int:
    """The shrink's input width; checks the shapes the kernels rely on."""
    in_dim = x.shape[1]
    if a.shape[2] != in_dim:
        raise ValueError(f"LoRA A is [.., {a.shape[2]}] wide but its input rows give {in_dim}")
    assert x.stride(1) == 1 and a.stride(2) == 1
    assert residual is None or (norm_weight is not None and residual.shape == x.shape
                                and residual.stride(1) == 1), "a residual goes with the norm"
    assert norm_weight is None or (norm_weight.shape == (in_dim,) and norm_weight.stride(0) == 1)
    return in_dim


def segment_bounds(segments: tuple[int, ...], out_dim: int) -> tuple[int, int]:
    """The first column of the second and third output segment (``out_dim`` when none)."""
    assert 1 <= len(segments) <= 3 and sum(segments) == out_dim
    bounds = [sum(segments[: j + 1]) for j in range(len(segments) - 1)]
    seg1, seg2 = (bounds + [out_dim, out_dim])[:2]
    return seg1, seg2


def shrink_split(in_dim: int, rank: int) -> int:
    """Width of one shrink program's ``K`` range: about ``SHRINK_RANGES`` ranges per row and
    segment, 64 to 512 columns wide, at most ``SHRINK_TILE`` ``A`` elements per program."""
    block_r = triton.next_power_of_2(rank)
    widest = max(16, SHRINK_TILE // block_r)
    return min(widest, 512, max(64, triton.next_power_of_2(triton.cdiv(in_dim, SHRINK_RANGES))))


def lora_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor,
                ranks: torch.Tensor, num_segments: int = 1,
                norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                residual: torch.Tensor | None = None) -> torch.Tensor:
    """``u[t] @ a[slots[t]]^T`` per row, ``u`` the prologue's rows of ``x`` (with the norm,
    of ``x + residual``: the new residual, which the projection after it stores), as fp32 partial
    sums ``[T, splits, S*R]`` over ``K`` ranges (their sum in range order is
    ``ref.lora_shrink`` before its rounding; :func:`lora_expand` takes them); one program
    per (row, output segment, range). Rows without an adapter, and rank rows past a slot's
    rank, are left unwritten (``lora_expand`` never reads them)."""
    prologue = PROLOGUE_PLAIN if norm_weight is None else PROLOGUE_NORM
    in_dim = _check(x, a, norm_weight, residual)
    t = x.shape[0]
    width = a.shape[1]
    assert width % num_segments == 0
    rank = width // num_segments
    range_k = shrink_split(in_dim, rank)
    splits = triton.cdiv(in_dim, range_k)
    if t > GROUPED_ABOVE and prologue == PROLOGUE_PLAIN:
        return grouped_shrink(x, a, slots, ranks, num_segments, range_k)
    out = torch.empty(t, splits, width, dtype=torch.float32, device=x.device)
    if t == 0:
        return out
    _shrink_kernel[(t, num_segments, splits)](
        x, residual if residual is not None else x,
        norm_weight if norm_weight is not None else x, a, out, slots, ranks, in_dim, eps,
        x.stride(0), (residual if residual is not None else x).stride(0), a.stride(0),
        a.stride(1), out.stride(0), out.stride(1), R=rank, PROLOGUE=prologue,
        HAS_RESIDUAL=residual is not None, BLOCK_R=triton.next_power_of_2(rank),
        RANGE_K=range_k,
        NORM_BLOCK=min(4096, triton.next_power_of_2(in_dim)), USE_PDL=pdl.ENABLED,
        num_warps=4, **pdl.LAUNCH,
    )
    return out


def lora_expand(y: torch.Tensor, s: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                ranks: torch.Tensor, scales: torch.Tensor,
                segments: tuple[int, ...]) -> torch.Tensor:
    """``y[t] += scales[l] * s[t, seg] @ b[l, seg]^T`` per output segment, ``l = slots[t]``
    (``ref.lora_expand``), in place; returns ``y``. ``s``: :func:`lora_shrink`'s partial
    sums, added here in range order and rounded to ``y``'s dtype. At most three segments
    (q, k, v)."""
    t, out_dim = y.shape
    assert b.shape[1] == out_dim and s.dim() == 3 and s.dtype == torch.float32
    assert y.stride(1) == 1 and s.stride(2) == 1 and b.stride(2) == 1
    seg1, seg2 = segment_bounds(segments, out_dim)
    rank = b.shape[2]
    if t > GROUPED_ABOVE:
        return grouped_expand(y, s, b, slots, ranks, scales, len(segments), seg1, seg2)
    if t == 0:
        return y
    block_n = min(128, triton.next_power_of_2(out_dim))
    _expand_kernel[(t, triton.cdiv(out_dim, block_n))](
        y, s, b, slots, ranks, scales, out_dim, seg1, seg2, s.shape[1], y.stride(0),
        s.stride(0), s.stride(1), b.stride(0), b.stride(1), R=rank, NUM_SEG=len(segments),
        BLOCK_R=triton.next_power_of_2(rank), BLOCK_N=block_n, USE_PDL=pdl.ENABLED,
        num_warps=4, **pdl.LAUNCH,
    )
    return y


def lora_add(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             slots: torch.Tensor, ranks: torch.Tensor, scales: torch.Tensor,
             segments: tuple[int, ...], norm_weight: torch.Tensor | None = None,
             eps: float = 0.0, residual: torch.Tensor | None = None) -> torch.Tensor:
    """``y`` plus each row's adapter delta of the prologue's rows of ``x`` (``ref.lora_add``),
    in place; returns ``y``: :func:`lora_shrink` then :func:`lora_expand`."""
    s = lora_shrink(x, a, slots, ranks, len(segments), norm_weight, eps, residual)
    return lora_expand(y, s, b, slots, ranks, scales, segments)
