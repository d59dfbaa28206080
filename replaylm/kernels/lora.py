"""Multi-adapter LoRA kernels: every row of a batch gathers its own adapter slot (BGMV-style).

A targeted projection's LoRA delta is ``y[t] += scale[l] * (u[t] @ A[l]^T) @ B[l]^T`` with
``l = slots[t]`` and ``u`` the projection's input rows. The adapter weights live in per-slot
static buffers (``replaylm.lora``): ``A`` ``[L, S*R, in]`` (``S`` output segments — q, k, v
of a fused qkv — each with ``R`` rank rows, ``R`` = ``max_lora_rank``) and ``B``
``[L, out, R]``.

The kernels compute ``u`` themselves from what the base projection read (its *prologue*), so
the base projection keeps its fused form (``kernels.skinny``'s RMSNorm and SiLU·mul
prologues): ``PROLOGUE_NORM`` reads the new residual rows and applies RMSNorm with the
layer's norm weight (qkv, gate_up); ``PROLOGUE_SILU`` reads ``gate_up`` and applies
SiLU(gate)·up (down); ``PROLOGUE_PLAIN`` reads ``u`` as it is (o_proj). The roundings are
those of the separate ops (``ref.lora_input``).

:func:`lora_add` picks one of two paths by the step's row count, a host-known shape (under
graphs the tier's padded size), so a captured graph always runs the same one:

* at most ``FUSED_MAX_ROWS`` rows (decode): one launch, :func:`lora_fused`. Each program owns
  a block of output columns and all rows; per adapter slot that any of its rows uses, it
  recomputes the rows' tiny shrink (``u @ A^T``, rank <= ``R``) for the segments its columns
  lie in, then adds the expand for its columns in place. No program needs another's result;
  the price is that every program re-reads the slot's ``A`` (from L2 after the first);
* more rows: two launches, :func:`lora_shrink` — program ``(t, segment, rank block)``
  computes ``BLOCK_R`` rank rows of ``u[t] @ A[l, seg]^T`` over the adapter's own rank — and
  :func:`lora_expand` — program ``(t, column block)`` adds ``scale * s[t, seg(n)] @
  B[l, n]^T`` to the output in place. ``A`` is read once per row.

A row whose slot is -1 (a base-model request, or padding) or whose slot is empty (rank 0)
reads no weight and its output row is left as it is, to the bit. Slot, rank and scale are
read on the device, so one captured graph serves every mix of adapters. The kernels launch
with PDL (``kernels.pdl``) and wait for the previous kernel before anything else. The torch
references are ``kernels.ref.lora_shrink`` / ``lora_expand`` / ``lora_add``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replaylm.kernels import pdl
from replaylm.kernels.dot import dot
from replaylm.kernels.pdl import wait_for_previous

#: Rank rows one shrink program computes.
SHRINK_ROWS = 4
#: Rows up to which :func:`lora_add` takes the one-launch fused kernel (its row block).
FUSED_MAX_ROWS = 16
#: What a kernel computes from its raw input before the shrink (``ref.lora_input``).
PROLOGUE_PLAIN, PROLOGUE_NORM, PROLOGUE_SILU = 0, 1, 2


@triton.jit
def _inv_rms(x_ptr, rows, row_ok, in_dim, stride_x, eps, BLOCK_M: tl.constexpr,
             BLOCK_K: tl.constexpr):
    """``1 / rms`` of each of ``rows`` (``[BLOCK_M]``) over ``in_dim`` columns, in fp32."""
    sq = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, in_dim, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        ok = row_ok[:, None] & (k < in_dim)[None, :]
        v = tl.load(x_ptr + rows[:, None] * stride_x + k[None, :], mask=ok,
                    other=0.0).to(tl.float32)
        sq += tl.sum(v * v, axis=1)
    return tl.rsqrt(sq / in_dim + eps)


@triton.jit
def _input_chunk(x_ptr, nw_ptr, rows, row_ok, inv_rms, k, in_dim, stride_x,
                 PROLOGUE: tl.constexpr):
    """The shrink's input rows ``rows`` at columns ``k`` (``[BM, BK]``), in the model dtype,
    rounded as the separate ops round (``ref.lora_input``); 0 outside ``row_ok``."""
    k_ok = k < in_dim
    ok = row_ok[:, None] & k_ok[None, :]
    ptrs = x_ptr + rows[:, None] * stride_x + k[None, :]
    x = tl.load(ptrs, mask=ok, other=0.0)
    dt = x.dtype
    if PROLOGUE == 1:  # RMSNorm: fp32, rounded, then times the weight (rounded again)
        w = tl.load(nw_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
        x = (x.to(tl.float32) * inv_rms[:, None]).to(dt)
        x = (x.to(tl.float32) * w[None, :]).to(dt)
    elif PROLOGUE == 2:  # SiLU(gate) * up; the rows are gate | up, each in_dim wide
        g = x.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        up = tl.load(ptrs + in_dim, mask=ok, other=0.0).to(tl.float32)
        x = (act * up).to(dt)
    return tl.where(ok, x, 0.0).to(dt)


@triton.jit(do_not_specialize=["in_dim"])
def _shrink_kernel(x_ptr, nw_ptr, a_ptr, s_ptr, slots_ptr, ranks_ptr, in_dim, eps, stride_x,
                   stride_al, stride_ar, stride_s, R: tl.constexpr, PROLOGUE: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_previous(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    seg = tl.program_id(1)
    r0 = tl.program_id(2) * BLOCK_R
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot >= 0:
        rank = tl.load(ranks_ptr + slot)
        if r0 < rank:
            rows = row + tl.zeros([1], dtype=tl.int64)  # this program's row, as a block
            row_ok = rows >= 0
            inv_rms = tl.full([1], 1.0, tl.float32)
            if PROLOGUE == 1:
                inv_rms = _inv_rms(x_ptr, rows, row_ok, in_dim, stride_x, eps, 1, BLOCK_K)
            r = r0 + tl.arange(0, BLOCK_R)
            r_ok = r < rank
            a_rows = a_ptr + slot * stride_al + (seg * R + r)[:, None] * stride_ar
            acc = tl.zeros([BLOCK_R], dtype=tl.float32)
            for k0 in range(0, in_dim, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                k_ok = k < in_dim
                xv = _input_chunk(x_ptr, nw_ptr, rows, row_ok, inv_rms, k, in_dim, stride_x,
                                  PROLOGUE).to(tl.float32)
                av = tl.load(a_rows + k[None, :], mask=r_ok[:, None] & k_ok[None, :],
                             other=0.0).to(tl.float32)
                acc += tl.sum(av * xv, axis=1)
            tl.store(s_ptr + row * stride_s + seg * R + r,
                     acc.to(s_ptr.dtype.element_ty), mask=r_ok)


@triton.jit(do_not_specialize=["out_dim", "seg1", "seg2"])
def _expand_kernel(y_ptr, s_ptr, b_ptr, slots_ptr, ranks_ptr, scales_ptr, out_dim, seg1, seg2,
                   stride_y, stride_s, stride_bl, stride_bn, R: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_previous(USE_PDL)
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


@triton.jit(do_not_specialize=["num_rows", "num_slots", "in_dim", "out_dim", "seg1", "seg2"])
def _fused_kernel(y_ptr, x_ptr, nw_ptr, a_ptr, b_ptr, slots_ptr, ranks_ptr, scales_ptr,
                  num_rows, num_slots, in_dim, out_dim, seg1, seg2, eps, stride_y, stride_x,
                  stride_al, stride_ar, stride_bl, stride_bn, R: tl.constexpr,
                  PROLOGUE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_previous(USE_PDL)
    rows = tl.arange(0, BLOCK_M)
    row_slot = tl.load(slots_ptr + rows, mask=rows < num_rows, other=-1)
    row_rank = tl.load(ranks_ptr + row_slot, mask=row_slot >= 0, other=0)
    has = row_rank > 0  # rows with an adapter: the only rows read or written
    if tl.sum(has.to(tl.int32)) > 0:
        dt = y_ptr.dtype.element_ty
        n0 = tl.program_id(0) * BLOCK_N
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < out_dim
        seg_n = (n >= seg1).to(tl.int32) + (n >= seg2).to(tl.int32)
        n_last = tl.minimum(n0 + BLOCK_N, out_dim) - 1
        seg_lo = (n0 >= seg1).to(tl.int32) + (n0 >= seg2).to(tl.int32)
        seg_hi = (n_last >= seg1).to(tl.int32) + (n_last >= seg2).to(tl.int32)
        inv_rms = tl.full([BLOCK_M], 1.0, tl.float32)
        if PROLOGUE == 1:
            inv_rms = _inv_rms(x_ptr, rows, has, in_dim, stride_x, eps, BLOCK_M, BLOCK_K)
        r = tl.arange(0, BLOCK_R)
        delta = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for slot in range(num_slots):
            mine = has & (row_slot == slot)
            if tl.sum(mine.to(tl.int32)) > 0:
                rank = tl.load(ranks_ptr + slot)
                r_ok = r < rank
                a_slot = a_ptr + slot * stride_al
                b_slot = b_ptr + slot * stride_bl
                part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for seg in range(seg_lo, seg_hi + 1):
                    a_rows = a_slot + (seg * R + r)[None, :] * stride_ar  # [1, BR]
                    s = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
                    for k0 in range(0, in_dim, BLOCK_K):
                        k = k0 + tl.arange(0, BLOCK_K)
                        xv = _input_chunk(x_ptr, nw_ptr, rows, mine, inv_rms, k, in_dim,
                                          stride_x, PROLOGUE)
                        at = tl.load(a_rows + k[:, None], mask=(k < in_dim)[:, None]
                                     & r_ok[None, :], other=0.0)  # [BK, BR]
                        s = s + dot(xv, at.to(dt))
                    # The shrink's result is rounded to the model dtype, as the two-launch
                    # path stores it.
                    bt = tl.load(b_slot + n[None, :] * stride_bn + r[:, None],
                                 mask=r_ok[:, None] & (n_ok & (seg_n == seg))[None, :],
                                 other=0.0)  # [BR, BN]
                    part += dot(s.to(dt), bt.to(dt))
                part = (part.to(dt).to(tl.float32) * tl.load(scales_ptr + slot)).to(dt)
                delta += tl.where(mine[:, None], part.to(tl.float32), 0.0)
        ptrs = y_ptr + rows[:, None] * stride_y + n[None, :]
        ok = has[:, None] & n_ok[None, :]
        y = tl.load(ptrs, mask=ok, other=0.0)
        tl.store(ptrs, (y.to(tl.float32) + delta).to(dt), mask=ok)


def _in_dim(x: torch.Tensor, prologue: int) -> int:
    return x.shape[1] // 2 if prologue == PROLOGUE_SILU else x.shape[1]


def _check(x: torch.Tensor, a: torch.Tensor, prologue: int,
           norm_weight: torch.Tensor | None) -> int:
    """The shrink's input width; checks the shapes the kernels rely on."""
    in_dim = _in_dim(x, prologue)
    if a.shape[2] != in_dim:
        raise ValueError(f"LoRA A is [.., {a.shape[2]}] wide but its input rows give {in_dim}")
    assert x.stride(1) == 1 and a.stride(2) == 1
    assert (norm_weight is not None) == (prologue == PROLOGUE_NORM)
    assert norm_weight is None or (norm_weight.shape == (in_dim,) and norm_weight.stride(0) == 1)
    return in_dim


def _prologue(norm_weight: torch.Tensor | None, silu: bool) -> int:
    if norm_weight is not None and silu:
        raise ValueError("a LoRA prologue is RMSNorm or SiLU·mul, not both")
    if norm_weight is not None:
        return PROLOGUE_NORM
    return PROLOGUE_SILU if silu else PROLOGUE_PLAIN


def _segment_bounds(segments: tuple[int, ...], out_dim: int) -> tuple[int, int]:
    """The first column of the second and third output segment (``out_dim`` when none)."""
    assert 1 <= len(segments) <= 3 and sum(segments) == out_dim
    bounds = [sum(segments[: j + 1]) for j in range(len(segments) - 1)]
    seg1, seg2 = (bounds + [out_dim, out_dim])[:2]
    return seg1, seg2


def lora_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor,
                ranks: torch.Tensor, num_segments: int = 1,
                norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                silu: bool = False) -> torch.Tensor:
    """``u[t] @ a[slots[t]]^T`` per row, ``u`` the prologue's rows of ``x``
    (``ref.lora_shrink``), one program per (row, output segment, rank block); rows without
    an adapter are left unwritten (``lora_expand`` never reads them). Each segment's rows
    are read up to the slot's rank only."""
    prologue = _prologue(norm_weight, silu)
    in_dim = _check(x, a, prologue, norm_weight)
    t = x.shape[0]
    width = a.shape[1]
    assert width % num_segments == 0
    rank = width // num_segments
    out = x.new_empty(t, width)
    if t == 0:
        return out
    block_r = min(SHRINK_ROWS, triton.next_power_of_2(rank))
    _shrink_kernel[(t, num_segments, triton.cdiv(rank, block_r))](
        x, norm_weight if norm_weight is not None else x, a, out, slots, ranks, in_dim, eps,
        x.stride(0), a.stride(0), a.stride(1), out.stride(0), R=rank, PROLOGUE=prologue,
        BLOCK_R=block_r, BLOCK_K=min(512, triton.next_power_of_2(in_dim)),
        USE_PDL=pdl.ENABLED, num_warps=4, **pdl.LAUNCH,
    )
    return out


def lora_expand(y: torch.Tensor, s: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                ranks: torch.Tensor, scales: torch.Tensor,
                segments: tuple[int, ...]) -> torch.Tensor:
    """``y[t] += scales[l] * s[t, seg] @ b[l, seg]^T`` per output segment, ``l = slots[t]``
    (``ref.lora_expand``), in place; returns ``y``. At most three segments (q, k, v)."""
    t, out_dim = y.shape
    assert b.shape[1] == out_dim
    assert y.stride(1) == 1 and s.stride(1) == 1 and b.stride(2) == 1
    seg1, seg2 = _segment_bounds(segments, out_dim)
    rank = b.shape[2]
    if t == 0:
        return y
    block_n = min(128, triton.next_power_of_2(out_dim))
    _expand_kernel[(t, triton.cdiv(out_dim, block_n))](
        y, s, b, slots, ranks, scales, out_dim, seg1, seg2, y.stride(0), s.stride(0),
        b.stride(0), b.stride(1), R=rank, BLOCK_R=triton.next_power_of_2(rank), BLOCK_N=block_n,
        USE_PDL=pdl.ENABLED, num_warps=4, **pdl.LAUNCH,
    )
    return y


def fused_block_n(out_dim: int) -> int:
    """Output columns per fused program: about 128 programs for the widest projections (one
    wave on an H200), 64 to 256 columns each; fewer programs re-read ``A`` fewer times."""
    return min(256, max(64, triton.next_power_of_2(triton.cdiv(out_dim, 128))),
               max(16, triton.next_power_of_2(out_dim)))


def lora_fused(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               slots: torch.Tensor, ranks: torch.Tensor, scales: torch.Tensor,
               segments: tuple[int, ...], norm_weight: torch.Tensor | None = None,
               eps: float = 0.0, silu: bool = False) -> torch.Tensor:
    """``ref.lora_add`` in one launch for at most ``FUSED_MAX_ROWS`` rows: prologue, shrink
    and expand, added to ``y`` in place; returns ``y``. Program ``j`` owns output columns
    ``j * BLOCK_N ..`` of every row and recomputes, per slot its rows use, their shrink."""
    prologue = _prologue(norm_weight, silu)
    in_dim = _check(x, a, prologue, norm_weight)
    t, out_dim = y.shape
    if t > FUSED_MAX_ROWS:
        raise ValueError(f"the fused LoRA kernel takes at most {FUSED_MAX_ROWS} rows, not {t}")
    assert x.shape[0] == t and b.shape[1] == out_dim and a.shape[0] == b.shape[0]
    assert y.stride(1) == 1 and b.stride(2) == 1
    seg1, seg2 = _segment_bounds(segments, out_dim)
    if t == 0:
        return y
    rank = b.shape[2]
    block_r = max(16, triton.next_power_of_2(rank))  # tl.dot needs 16 on every side
    block_n = fused_block_n(out_dim)
    block_k = max(16, min(256, triton.next_power_of_2(in_dim)))
    _fused_kernel[(triton.cdiv(out_dim, block_n),)](
        y, x, norm_weight if norm_weight is not None else x, a, b, slots, ranks, scales, t,
        a.shape[0], in_dim, out_dim, seg1, seg2, eps, y.stride(0), x.stride(0), a.stride(0),
        a.stride(1), b.stride(0), b.stride(1), R=rank, PROLOGUE=prologue,
        BLOCK_M=FUSED_MAX_ROWS, BLOCK_R=block_r, BLOCK_N=block_n, BLOCK_K=block_k,
        USE_PDL=pdl.ENABLED, num_warps=4, **pdl.LAUNCH,
    )
    return y


def lora_add(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             slots: torch.Tensor, ranks: torch.Tensor, scales: torch.Tensor,
             segments: tuple[int, ...], norm_weight: torch.Tensor | None = None,
             eps: float = 0.0, silu: bool = False) -> torch.Tensor:
    """``y`` plus each row's adapter delta of the prologue's rows of ``x`` (``ref.lora_add``),
    in place; returns ``y``. At most ``FUSED_MAX_ROWS`` rows: one launch (:func:`lora_fused`);
    more: :func:`lora_shrink` then :func:`lora_expand`. The row count is the batch's (under
    graphs the tier's) size, so a graph always runs the path it was captured with."""
    if y.shape[0] <= FUSED_MAX_ROWS:
        return lora_fused(y, x, a, b, slots, ranks, scales, segments, norm_weight, eps, silu)
    s = lora_shrink(x, a, slots, ranks, len(segments), norm_weight, eps, silu)
    return lora_expand(y, s, b, slots, ranks, scales, segments)
