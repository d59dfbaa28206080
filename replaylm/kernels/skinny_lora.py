"""The skinny projection with a LoRA epilogue: a projection and its adapters' delta in one
launch at a few rows (``kernels.skinny``'s kernel, plus the second half of ``kernels.lora``).

A LoRA projection at a decode step is the shrink (``lora.lora_shrink``: fp32 partial sums of
``u @ A[slot]^T`` over ranges of ``K``, into ``[T, splits, S*R]``), then this kernel: the
skinny projection of ``kernels.skinny`` (plain or with the RMSNorm prologue; same tiles and
PDL) whose epilogue adds, to each live row's fp32 sums, ``scale[slot] * s @ B[slot]^T`` over
its strip of output columns, before the one rounding to the model dtype. ``s`` is the
shrink's partial sums added in range order and rounded to the model dtype, as
``lora.lora_expand`` rounds it; the delta itself is not rounded (``lora_expand`` adds a
rounded delta to the rounded projection). The reference is ``ref.lora_linear``.

A row whose slot is -1 (a base-model row, padding) or empty (rank 0) costs its slot index
and nothing more: the epilogue is skipped when no row of the tile is live, and a tile's
dead rows are stored as the plain kernel computes them. Slot, rank and scale are read on
the device, so one captured graph serves every mix of adapters.

It shares ``_skinny_kernel``'s strip loads, main loop and epilogues (``skinny._load_strip``,
``_strip_sums``, ``_epilogue``, the paired SiLU·mul store), runs whole-K tiles only (a
split-K tile's reduction pass would need the delta instead) and takes the tile the tuner
chose for the base projection. ``kernels.ops`` decides when to fold: where the projection
(with the norm prologue, or plain: o, down, and qkv or gate_up after a separate norm) runs
a whole-K skinny tile; otherwise the projection runs as without LoRA and ``lora_expand``
follows. The op launches the shrink right before this kernel, so it may form its sums
before its PDL wait.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replaylm.kernels import skinny
from replaylm.kernels.lora import segment_bounds
from replaylm.kernels.pdl import release_next, wait_previous
from replaylm.kernels.ref import LoRADelta
from replaylm.kernels.skinny import _load_strip, _strip_sums
from replaylm.kernels.skinny_epilogue import _epilogue, _store_silu_pairs


@triton.jit
def _lora_weights(lb_ptr, slots_ptr, ranks_ptr, scales_ptr, offs_m, m_mask, offs_n, n_mask,
                  stride_lbl, stride_lbn, BLOCK_R: tl.constexpr):
    """What the delta reads that no kernel of the step writes, so it is read before the PDL
    wait: each row's slot (copied in before the step's first kernel), the slot's rank and
    scale and the strip's ``B`` rows (written between steps only). Returns ``(b, rank,
    scale)``: ``b`` ``[BLOCK_M, BLOCK_N, BLOCK_R]`` in ``B``'s dtype, 0 past a row's rank;
    a dead row (slot -1 or rank 0) has rank 0 and reads no ``B``."""
    slot = tl.load(slots_ptr + offs_m, mask=m_mask, other=-1)
    row_slot = tl.maximum(slot, 0).to(tl.int64)
    rank = tl.load(ranks_ptr + row_slot, mask=slot >= 0, other=0)
    scale = tl.load(scales_ptr + row_slot, mask=slot >= 0, other=0.0)
    r = tl.arange(0, BLOCK_R)
    r_ok = r[None, :] < rank[:, None]  # [BM, BR]: none on a dead row
    b = tl.load(lb_ptr + row_slot[:, None, None] * stride_lbl + offs_n[None, :, None] * stride_lbn
                + r[None, None, :], mask=r_ok[:, None, :] & n_mask[None, :, None], other=0.0)
    return b, rank, scale


@triton.jit
def _lora_delta(y_ptr, lp_ptr, b, rank, scale, offs_m, offs_n, n_lo, n_hi, seg1, seg2,
                stride_lpt, stride_lps, R: tl.constexpr, NUM_SEG: tl.constexpr,
                SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_R: tl.constexpr):
    """``scale * s @ B^T`` of each row of the tile over columns ``offs_n`` (fp32
    ``[BLOCK_M, BLOCK_N]``), from ``_lora_weights``'s ``b``, ``rank`` and ``scale`` and the
    shrink's partial sums (read here, after the wait); and which rows are live."""
    live = rank > 0
    delta = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if tl.max(live.to(tl.int32), axis=0) > 0:
        dt = y_ptr.dtype.element_ty
        r = tl.arange(0, BLOCK_R)
        r_ok = r[None, :] < rank[:, None]
        bf = b.to(tl.float32)
        seg = (offs_n >= seg1).to(tl.int32) + (offs_n >= seg2).to(tl.int32)
        seg_lo = (n_lo >= seg1).to(tl.int32) + (n_lo >= seg2).to(tl.int32)
        seg_hi = (n_hi >= seg1).to(tl.int32) + (n_hi >= seg2).to(tl.int32)
        for j in tl.static_range(NUM_SEG):
            if (seg_lo <= j) & (j <= seg_hi):  # the strip has columns of segment j
                # Its shrink: the ranges' partial sums in range order, rounded to the model
                # dtype as a separate LoRA branch stores it.
                s_ptrs = lp_ptr + offs_m[:, None] * stride_lpt + j * R + r[None, :]
                sj = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
                for sp in tl.static_range(SPLITS):
                    sj += tl.load(s_ptrs + sp * stride_lps, mask=r_ok, other=0.0)
                sj = sj.to(dt).to(tl.float32)
                part = tl.sum(bf * sj[:, None, :], axis=2)
                delta += tl.where((seg == j)[None, :], part, 0.0)
        delta = delta * scale[:, None]
    return delta, live


@triton.jit(do_not_specialize=["seg1", "seg2"])
def _skinny_lora_kernel(x_ptr, r_ptr, nw_ptr, res_out_ptr, w_ptr, s_ptr, b_ptr, y_ptr, part_ptr,
                        M, N, eps, stride_xm, stride_rm, stride_om, stride_wn, stride_ym,
                        lp_ptr, lb_ptr, slots_ptr, ranks_ptr, scales_ptr, seg1, seg2,
                        stride_lpt, stride_lps, stride_lbl, stride_lbn,
                        K: tl.constexpr, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                        HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr,
                        EVEN_K: tl.constexpr, CHUNKS: tl.constexpr, WHOLE: tl.constexpr,
                        SPLIT_K: tl.constexpr, USE_PDL: tl.constexpr,
                        SILU_PAIRS: tl.constexpr, R: tl.constexpr,
                        NUM_SEG: tl.constexpr, SPLITS: tl.constexpr, BLOCK_R: tl.constexpr):
    """``skinny._skinny_kernel`` for whole-K tiles (``SPLIT_K`` 1, ``part_ptr`` unused) with
    the LoRA delta (``_lora_delta``) added to its fp32 sums before the store (with
    ``SILU_PAIRS``, before SiLU·mul of the paired gate and up rows)."""
    pid = tl.program_id(0)
    if SILU_PAIRS:  # the strip of paired gate and up rows, as in ``_skinny_kernel``
        pair = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N) % (BLOCK_N // 2)
        offs_n = tl.where(tl.arange(0, BLOCK_N) < BLOCK_N // 2, pair, pair + N // 2)
        n_mask = pair < N // 2
        n_lo = pid * (BLOCK_N // 2)  # a gate row and an up row: both segments
        n_hi = N // 2 + n_lo
    else:
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        n_lo = pid * BLOCK_N
        n_hi = tl.minimum(n_lo + BLOCK_N, N) - 1
    offs_m = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    # The weight strip and the LoRA weights before the PDL wait, as in ``_skinny_kernel``.
    w_ptrs, w0, w1, w2, w3 = _load_strip(w_ptr, offs_n, n_mask, cols, 0, stride_wn, K, BLOCK_K,
                                         EVEN_N, EVEN_K, CHUNKS, WHOLE)
    b, rank, scale = _lora_weights(lb_ptr, slots_ptr, ranks_ptr, scales_ptr, offs_m, m_mask,
                                   offs_n, n_mask, stride_lbl, stride_lbn, BLOCK_R)
    # Launched right after the shrink, which let this kernel be scheduled only once
    # everything before it had completed (``pdl.release_after_wait``): the input rows are
    # final, so the sums run at once, beside the shrink; the wait comes before its sums
    # are read.
    release_next(USE_PDL)
    out, sq = _strip_sums(w_ptrs, w0, w1, w2, w3, n_mask, 0, K, x_ptr, r_ptr, nw_ptr,
                          res_out_ptr, offs_m, m_mask, cols, pid == 0, stride_xm, stride_rm,
                          stride_om, K, PROLOGUE, HAS_RESIDUAL, BLOCK_M, BLOCK_N, BLOCK_K,
                          EVEN_N, EVEN_K, CHUNKS, WHOLE)
    wait_previous(USE_PDL)
    delta, live = _lora_delta(y_ptr, lp_ptr, b, rank, scale, offs_m, offs_n, n_lo, n_hi, seg1,
                              seg2, stride_lpt, stride_lps, R, NUM_SEG, SPLITS, BLOCK_M,
                              BLOCK_N, BLOCK_R)
    out = _epilogue(out, sq, s_ptr, b_ptr, offs_n, n_mask, eps, K, PROLOGUE, HAS_SCALE, HAS_BIAS)
    out = tl.where(live[:, None], out + delta, out)  # a dead row: the plain kernel's sums
    if SILU_PAIRS:
        _store_silu_pairs(out, y_ptr, offs_m, m_mask, pid, N // 2, stride_ym, BLOCK_M, BLOCK_N)
    else:
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
                 out.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def foldable(config: tuple[int, ...] | None) -> bool:
    """Whether the skinny tile ``config`` (a tuner decision; None: cuBLAS or the unfused
    ops) can carry the LoRA epilogue: a whole-K tile."""
    return config is not None and (len(config) == 4 or config[4] <= 1)


def _epilogue_args(lora: LoRADelta, out_dim: int) -> dict:
    """The LoRA kernel's arguments past ``_skinny_kernel``'s, from ``lora`` (the shrink's
    fp32 partials ``[T, splits, S*R]``, ``kernels.lora.lora_shrink``)."""
    s, b = lora.s, lora.b
    assert s.dim() == 3 and s.dtype == torch.float32 and s.stride(2) == 1
    assert b.shape[1] == out_dim and b.stride(2) == 1
    rank = b.shape[2]
    assert s.shape[2] == len(lora.segments) * rank
    seg1, seg2 = segment_bounds(lora.segments, out_dim)
    return dict(lp_ptr=s, lb_ptr=b, slots_ptr=lora.slots, ranks_ptr=lora.ranks,
                scales_ptr=lora.scales, seg1=seg1, seg2=seg2, stride_lpt=s.stride(0),
                stride_lps=s.stride(1), stride_lbl=b.stride(0), stride_lbn=b.stride(1), R=rank,
                NUM_SEG=len(lora.segments), SPLITS=s.shape[1],
                BLOCK_R=triton.next_power_of_2(rank))


def _launch(mode: int, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            lora: LoRADelta, config: tuple[int, ...], **kw) -> tuple[torch.Tensor,
                                                                    torch.Tensor | None]:
    assert 0 < x.shape[0] <= skinny.MAX_M and foldable(config)
    return skinny._launch(mode, x, weight, bias, config, kernel=_skinny_lora_kernel,
                          extra=_epilogue_args(lora, weight.shape[0]), **kw)


def lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                lora: LoRADelta, config: tuple[int, ...], out: torch.Tensor | None = None,
                scale: torch.Tensor | None = None, silu_pairs: bool = False) -> torch.Tensor:
    """``skinny.skinny_linear`` with ``lora``'s delta folded in (``ref.lora_linear``);
    ``silu_pairs``: ``weight`` is ``[gate | up]`` and the result ``silu_and_mul`` of that."""
    return _launch(skinny.PROLOGUE_PLAIN, x, weight, bias, lora, config, out=out,
                   scale=scale, silu_pairs=silu_pairs)[0]


def lora_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                     eps: float, weight: torch.Tensor, bias: torch.Tensor | None,
                     lora: LoRADelta, config: tuple[int, ...],
                     scale: torch.Tensor | None = None, silu_pairs: bool = False,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``skinny.skinny_norm_linear`` with ``lora``'s delta folded in; returns
    ``(y, new_residual)``. ``silu_pairs``: as for :func:`lora_linear`."""
    y, new_res = _launch(skinny.PROLOGUE_NORM, x, weight, bias, lora, config,
                         residual=residual, norm_weight=norm_weight, eps=eps, scale=scale,
                         silu_pairs=silu_pairs)
    return y, (x if new_res is None else new_res)

