"""Skinny matmul for decode: ``y = x @ W^T (+ b)`` with few rows in ``x`` (batch-1 decode).

At one to a few tokens a projection is a pure weight stream: every weight byte is read once
and used ``M`` times. cuBLAS picks tile shapes made for larger ``M`` and, on the small square
projections of 0.6B-1B models, reaches under half of the H200's bandwidth. This kernel gives
each program a strip of ``BLOCK_N`` weight rows and the whole ``K``: it streams the strip in
``BLOCK_K`` chunks, multiplies each chunk by all ``M`` rows of ``x`` and reduces in fp32. No
split-K, so there are no atomics and the result is bit-for-bit repeatable (graph replays and
their eager re-runs agree exactly).

``skinny_linear`` runs it for ``M <= MAX_M`` and falls back to ``torch.nn.functional.linear``
otherwise; ``skinny_linear_ref`` is the fp32-accumulating torch reference.

The kernel can also compute its input rows itself, which removes a launch (and its gap in
the graph) per projection: ``skinny_norm_linear`` folds the residual add + RMSNorm in front
of a projection (each program sums the squares of the few input rows as it streams them and
scales its outputs by 1/rms at the end; program 0 stores the new residual),
``skinny_silu_linear`` folds SiLU(gate)·up in front of down_proj. Behind the qkv projection,
``skinny_norm_linear_rope`` also does the rotary kernel's work (q/k norm, rotary, KV write):
the last program of each head to finish (an atomic arrival count) normalises and rotates it.

Neither wins everywhere (measured on the H200 in CUDA graphs: at one row, Qwen3-0.6B's
o_proj, 1024x2048, takes 12.6 µs in cuBLAS and 2.3 µs here; at four rows its qkv, 4096x1024,
is faster in cuBLAS, 3.9 µs). So ``linear``, what the model's layers
call, times both once per shape on the device, each replayed from a CUDA graph, and keeps the
fastest of cuBLAS and a few tile candidates; ``LINEAR_CHOICES`` records every decision. The
fused prologues are decided the same way (``choose``), against the separate op + ``linear``.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from replaylm.attention.backend import BLOCK_SIZE as PAGE_SIZE
from replaylm.graphs.capture import gc_paused
from replaylm.kernels import pdl
from replaylm.kernels.pdl import wait_for_previous
from replaylm.kernels.rope import RotaryArgs, norm_rope

log = logging.getLogger(__name__)

MAX_M = 8  # above this, cuBLAS' tensor-core tiles win
#: What the kernel computes on its input rows before the product (``_skinny_kernel``).
PROLOGUE_PLAIN, PROLOGUE_NORM, PROLOGUE_SILU = 0, 1, 2
#: K chunks up to which a program's weight strip is loaded whole before the PDL wait
#: (``_skinny_kernel`` spells out four chunks).
MAX_UNROLL = 4

#: (prologue, m, n, k, dtype, has_bias) -> (kernel config, or None for the unfused path; its
#: µs; the unfused path's µs). Prologue "plain" is a bare projection (unfused = cuBLAS);
#: "norm" and "silu" fold the residual add + RMSNorm or SiLU·mul into the projection's input
#: (unfused = that op's own kernel, then ``linear``).
LINEAR_CHOICES: dict[tuple, tuple[tuple[int, int, int, int] | None, float, float]] = {}


def skinny_linear_ref(x: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    y = x.float() @ weight.float().t()
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)


@triton.jit
def _weight_chunk(w_ptrs, k0, n_mask, cols, K: tl.constexpr, EVEN_N: tl.constexpr,
                  EVEN_K: tl.constexpr):
    if EVEN_N and EVEN_K:
        return tl.load(w_ptrs + k0, eviction_policy="evict_first")
    return tl.load(w_ptrs + k0, mask=n_mask[:, None] & ((k0 + cols) < K)[None, :], other=0.0,
                   eviction_policy="evict_first")


@triton.jit
def _input_chunk(x_ptrs, r_ptrs, nw_ptr, out_ptrs, k0, mask, cols, store_residual,
                 K: tl.constexpr, BLOCK_M: tl.constexpr, PROLOGUE: tl.constexpr,
                 HAS_RESIDUAL: tl.constexpr):
    """One ``[BLOCK_M, BLOCK_K]`` chunk of the projection's input in fp32, and (RMSNorm
    prologue) its rows' sum of squares."""
    x = tl.load(x_ptrs + k0, mask=mask, other=0.0)
    dt = x.dtype
    sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if PROLOGUE == 1:  # residual add + RMSNorm; the 1/rms scale is applied after the sum
        if HAS_RESIDUAL:
            r = tl.load(r_ptrs + k0, mask=mask, other=0.0)
            # Rounded to the model dtype: that is the residual the next layer reads.
            x = (x.to(tl.float32) + r.to(tl.float32)).to(dt)
            if store_residual:
                tl.store(out_ptrs + k0, x, mask=mask)
        s = x.to(tl.float32)
        sq = tl.sum(s * s, axis=1)
        w = tl.load(nw_ptr + k0 + cols, mask=(k0 + cols) < K, other=0.0).to(tl.float32)
        return s * w[None, :], sq
    if PROLOGUE == 2:  # SiLU(gate) * up: ``x`` rows are gate | up, each K wide
        g = x.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        u = tl.load(x_ptrs + K + k0, mask=mask, other=0.0).to(tl.float32)
        return (act * u).to(dt).to(tl.float32), sq
    return x.to(tl.float32), sq


@triton.jit
def _accumulate(acc, sq, w, k0, x_ptrs, r_ptrs, nw_ptr, out_ptrs, m_mask, cols, store_residual,
                K: tl.constexpr, BLOCK_M: tl.constexpr, PROLOGUE: tl.constexpr,
                HAS_RESIDUAL: tl.constexpr, EVEN_K: tl.constexpr):
    """Fold weight chunk ``w`` (at column ``k0``) and the matching input chunk into the sums.
    Products accumulate elementwise; the one cross-thread reduction comes after the last
    chunk, so this is loads and FMAs only."""
    if EVEN_K:
        mask = m_mask[:, None]
    else:
        mask = m_mask[:, None] & ((k0 + cols) < K)[None, :]
    x, sq_k = _input_chunk(x_ptrs, r_ptrs, nw_ptr, out_ptrs, k0, mask, cols, store_residual,
                           K, BLOCK_M, PROLOGUE, HAS_RESIDUAL)
    return acc + w.to(tl.float32)[None, :, :] * x[:, None, :], sq + sq_k


@triton.jit
def _rope_epilogue(out, pid, offs_m, offs_n, m_mask, y_ptr, stride_ym, counter_ptr, q_out_ptr,
                   kc_ptr, vc_ptr, stride_qm, stride_kcb, stride_kcs, stride_vcb, stride_vcs,
                   slot, cos, sin, w1, w2, eps, BLOCK_N: tl.constexpr, HQ: tl.constexpr,
                   HKV: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                   HAS_QK_NORM: tl.constexpr):
    """The qkv projection's tail when it does the rotary kernel's work (``ROPE``).

    A program's strip lies inside one head (``BLOCK_N`` divides ``HEAD_DIM``). A v head's
    programs store their columns straight into ``v_cache``. A q or k head needs all its
    columns at once (the q/k norm sums over the head, rotation pairs ``d`` with
    ``d + HEAD_DIM/2``), so its programs store the raw columns to ``y``, count themselves in
    with an atomic, and the last to arrive reads the head back, normalises and rotates it and
    stores it into ``q_out`` or ``k_cache``, then resets the count (as split-KV attention
    merges its partials)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    head = pid * BLOCK_N // HEAD_DIM
    dt = y_ptr.dtype.element_ty
    has_slot = m_mask & (slot >= 0)
    blk = slot // PAGE
    off = slot % PAGE
    if head >= HQ + HKV:
        col = offs_n - HQ * HEAD_DIM - HKV * HEAD_DIM  # kv head * HEAD_DIM + column
        vc = vc_ptr + (blk * stride_vcb + off * stride_vcs)[:, None] + col[None, :]
        tl.store(vc, out.to(dt).to(vc_ptr.dtype.element_ty), mask=has_slot[:, None])
    else:
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], out.to(dt),
                 mask=m_mask[:, None])
        tl.debug_barrier()  # the head's columns are written before the arrival is counted
        arrived = tl.atomic_add(counter_ptr + head, 1, sem="acq_rel", scope="gpu")
        if arrived == HEAD_DIM // BLOCK_N - 1:
            tl.atomic_xchg(counter_ptr + head, 0, sem="relaxed", scope="gpu")  # for reuse
            d = tl.arange(0, HALF)
            src = y_ptr + offs_m[:, None] * stride_ym + head * HEAD_DIM + d[None, :]
            # Other programs wrote these columns: bypass L1.
            x1 = tl.load(src, mask=m_mask[:, None], other=0.0, cache_modifier=".cg")
            x2 = tl.load(src + HALF, mask=m_mask[:, None], other=0.0, cache_modifier=".cg")
            o1, o2 = norm_rope(x1, x2, w1, w2, cos, sin, eps, HALF, HAS_QK_NORM)
            if head < HQ:
                qo = q_out_ptr + offs_m[:, None] * stride_qm + head * HEAD_DIM + d[None, :]
                tl.store(qo, o1, mask=m_mask[:, None])
                tl.store(qo + HALF, o2, mask=m_mask[:, None])
            else:
                kc = (kc_ptr + (blk * stride_kcb + off * stride_kcs)[:, None]
                      + (head - HQ) * HEAD_DIM + d[None, :])
                tl.store(kc, o1.to(kc_ptr.dtype.element_ty), mask=has_slot[:, None])
                tl.store(kc + HALF, o2.to(kc_ptr.dtype.element_ty), mask=has_slot[:, None])


@triton.jit
def _skinny_kernel(x_ptr, r_ptr, nw_ptr, res_out_ptr, w_ptr, b_ptr, y_ptr, M, N, eps,
                   stride_xm, stride_rm, stride_om, stride_wn, stride_ym,
                   counter_ptr, q_out_ptr, kc_ptr, vc_ptr, pos_ptr, slot_ptr, cs_ptr, qw_ptr,
                   kw_ptr, rope_eps, stride_qm, stride_kcb, stride_kcs, stride_vcb, stride_vcs,
                   stride_cs,
                   K: tl.constexpr, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
                   CHUNKS: tl.constexpr, WHOLE: tl.constexpr, USE_PDL: tl.constexpr,
                   ROPE: tl.constexpr = False, HQ: tl.constexpr = 1, HKV: tl.constexpr = 1,
                   HEAD_DIM: tl.constexpr = 2, PAGE: tl.constexpr = 16,
                   HAS_QK_NORM: tl.constexpr = False):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    # Weights are never written by an earlier kernel, so a strip of up to MAX_UNROLL chunks
    # (WHOLE) is loaded whole before the PDL wait: with PDL the weight stream then overlaps the
    # previous kernel, and only the (tiny) input rows are read after it. A longer strip
    # loads its first chunk early and streams the rest in a loop (unrolling 16-56 chunks
    # multiplies compile and tuning time).
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + cols[None, :]
    w0 = _weight_chunk(w_ptrs, 0, n_mask, cols, K, EVEN_N, EVEN_K)
    w1 = w0  # placeholders; chunks past the strip's end are never used
    w2 = w0
    w3 = w0
    if WHOLE and CHUNKS > 1:
        w1 = _weight_chunk(w_ptrs, BLOCK_K, n_mask, cols, K, EVEN_N, EVEN_K)
    if WHOLE and CHUNKS > 2:
        w2 = _weight_chunk(w_ptrs, 2 * BLOCK_K, n_mask, cols, K, EVEN_N, EVEN_K)
    if WHOLE and CHUNKS > 3:
        w3 = _weight_chunk(w_ptrs, 3 * BLOCK_K, n_mask, cols, K, EVEN_N, EVEN_K)
    if ROPE:
        # The step's positions and slots, the rotary table and the q/k norm weights are not
        # written by the previous kernel either: read them before the wait.
        HALF: tl.constexpr = HEAD_DIM // 2
        d = tl.arange(0, HALF)
        slot = tl.load(slot_ptr + offs_m, mask=m_mask, other=-1).to(tl.int64)
        pos = tl.load(pos_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
        cs = cs_ptr + pos[:, None] * stride_cs + d[None, :]
        dt = y_ptr.dtype.element_ty
        cos = tl.load(cs).to(dt).to(tl.float32)
        sin = tl.load(cs + HALF).to(dt).to(tl.float32)
        hw1 = cos  # the head's norm weight halves; placeholders without q/k norm
        hw2 = sin
        if HAS_QK_NORM:
            q_side = pid * BLOCK_N < HQ * HEAD_DIM
            hw1 = tl.where(q_side, tl.load(qw_ptr + d), tl.load(kw_ptr + d)).to(tl.float32)
            hw2 = tl.where(q_side, tl.load(qw_ptr + HALF + d),
                           tl.load(kw_ptr + HALF + d)).to(tl.float32)
    wait_for_previous(USE_PDL)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + cols[None, :]
    r_ptrs = r_ptr + offs_m[:, None] * stride_rm + cols[None, :]
    out_ptrs = res_out_ptr + offs_m[:, None] * stride_om + cols[None, :]
    store_residual = pid == 0  # one program writes the new residual
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc, sq = _accumulate(acc, sq, w0, 0, x_ptrs, r_ptrs, nw_ptr, out_ptrs, m_mask, cols,
                          store_residual, K, BLOCK_M, PROLOGUE, HAS_RESIDUAL, EVEN_K)
    if WHOLE:
        if CHUNKS > 1:
            acc, sq = _accumulate(acc, sq, w1, BLOCK_K, x_ptrs, r_ptrs, nw_ptr, out_ptrs,
                                  m_mask, cols, store_residual, K, BLOCK_M, PROLOGUE,
                                  HAS_RESIDUAL, EVEN_K)
        if CHUNKS > 2:
            acc, sq = _accumulate(acc, sq, w2, 2 * BLOCK_K, x_ptrs, r_ptrs, nw_ptr, out_ptrs,
                                  m_mask, cols, store_residual, K, BLOCK_M, PROLOGUE,
                                  HAS_RESIDUAL, EVEN_K)
        if CHUNKS > 3:
            acc, sq = _accumulate(acc, sq, w3, 3 * BLOCK_K, x_ptrs, r_ptrs, nw_ptr, out_ptrs,
                                  m_mask, cols, store_residual, K, BLOCK_M, PROLOGUE,
                                  HAS_RESIDUAL, EVEN_K)
    else:
        for k0 in range(BLOCK_K, K, BLOCK_K):
            w = _weight_chunk(w_ptrs, k0, n_mask, cols, K, EVEN_N, EVEN_K)
            acc, sq = _accumulate(acc, sq, w, k0, x_ptrs, r_ptrs, nw_ptr, out_ptrs, m_mask,
                                  cols, store_residual, K, BLOCK_M, PROLOGUE, HAS_RESIDUAL,
                                  EVEN_K)
    out = tl.sum(acc, axis=2)  # [BM, BN]
    if PROLOGUE == 1:
        # sum_k w[n,k] * (s[k] * rstd) * g[k] == rstd * sum_k w[n,k] * s[k] * g[k]: the row
        # scale leaves the sum, so one pass serves both the norm and the product.
        out = out * tl.rsqrt(sq / K + eps)[:, None]
    if HAS_BIAS:
        out += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if ROPE:
        _rope_epilogue(out, pid, offs_m, offs_n, m_mask, y_ptr, stride_ym, counter_ptr,
                       q_out_ptr, kc_ptr, vc_ptr, stride_qm, stride_kcb, stride_kcs, stride_vcb,
                       stride_vcs, slot, cos, sin, hw1, hw2, rope_eps, BLOCK_N, HQ, HKV, HEAD_DIM,
                       PAGE, HAS_QK_NORM)
    else:
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
                 out.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


#: Tile candidates (BLOCK_N, BLOCK_K, num_warps) per row-block size; ``linear`` times each.
CANDIDATES: dict[int, list[tuple[int, int, int]]] = {
    1: [(4, 512, 4), (8, 512, 4), (8, 1024, 8), (16, 512, 8), (4, 1024, 4), (2, 1024, 4),
        (8, 256, 4), (16, 256, 4), (2, 2048, 4), (4, 2048, 8)],
    2: [(4, 256, 4), (8, 256, 4), (4, 512, 8), (8, 512, 8), (2, 1024, 4), (4, 1024, 8)],
    4: [(4, 128, 4), (4, 256, 8), (8, 128, 4), (8, 256, 8)],
    8: [(2, 128, 4), (4, 128, 4), (4, 128, 8), (8, 64, 4)],
}


#: Relative timing difference under which the tuner treats two tiles as equal (``_tune``).
TIE = 0.02


def candidate_configs(m: int, k: int) -> list[tuple[int, int, int, int]]:
    """Every tile ``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps)`` the tuner times for ``m`` rows
    and reduction length ``k``: ``CANDIDATES`` with ``BLOCK_K`` capped at ``k``'s next power
    of two."""
    bm = triton.next_power_of_2(m)
    return [(bm, bn, min(bk, triton.next_power_of_2(k)), warps) for bn, bk, warps in CANDIDATES[bm]]


def pick_config(m: int, n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) without measuring: the first candidate whose
    strips cover the SMs about twice."""
    block_m = triton.next_power_of_2(max(m, 1))
    cands = CANDIDATES[min(block_m, 8)]
    for bn, bk, warps in cands:
        if triton.cdiv(n, bn) >= 256:
            return block_m, bn, min(bk, triton.next_power_of_2(k)), warps
    bn, bk, warps = min(cands)
    return block_m, bn, min(bk, triton.next_power_of_2(k)), warps


@dataclass(frozen=True, kw_only=True)
class QkvRope(RotaryArgs):
    """What the rotary kernel (``fused.rotary``) does after the qkv projection, done by the
    projection itself (``skinny_norm_linear_rope``). The projection's output columns are
    q | k | v heads of ``head_dim``; k and v go to ``k_cache``/``v_cache``."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    k_cache: torch.Tensor
    v_cache: torch.Tensor


#: Arrival counters per head of the rotary epilogue, per device (zero between launches).
MAX_ROPE_HEADS = 1024


@functools.cache
def _head_counters(device: torch.device) -> torch.Tensor:
    """Per-head arrival counts of the rotary epilogue, zero between launches (the head's last
    program resets its own). One buffer per device, allocated at warm-up before any capture:
    the projections of one device run on one stream, one after another."""
    return torch.zeros(MAX_ROPE_HEADS, dtype=torch.int32, device=device)


def rope_fits(rope: QkvRope, config: tuple[int, int, int, int] | None) -> bool:
    """Whether the rotary epilogue can run with tile ``config``: each program's strip must
    lie inside one head, and the caches must be ``[blocks, page, Hkv, D]`` with contiguous
    heads."""
    if config is None or rope.head_dim % config[1] or rope.head_dim % 2:
        return False
    d = rope.head_dim
    return all(c.stride(-1) == 1 and c.stride(-2) == d for c in (rope.k_cache, rope.v_cache))


def _rope_args(rope: QkvRope | None, x: torch.Tensor, q_out: torch.Tensor | None) -> tuple:
    """The kernel's rotary arguments (pointers, eps, strides), dummies without ``rope``."""
    if rope is None:
        return (x,) * 9 + (0.0,) + (0,) * 6
    has_norm = rope.q_norm_weight is not None
    qw = rope.q_norm_weight if has_norm else rope.cos_sin
    kw = rope.k_norm_weight if has_norm else rope.cos_sin
    kc, vc = rope.k_cache, rope.v_cache
    return (_head_counters(x.device), q_out, kc, vc, rope.positions, rope.slot_mapping,
            rope.cos_sin, qw, kw, rope.eps, q_out.stride(0), kc.stride(0), kc.stride(1),
            vc.stride(0), vc.stride(1), rope.cos_sin.stride(0))


def _launch(mode: int, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            config: tuple[int, int, int, int] | None, residual: torch.Tensor | None = None,
            norm_weight: torch.Tensor | None = None, eps: float = 0.0,
            rope: QkvRope | None = None, out: torch.Tensor | None = None,
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the skinny kernel with prologue ``mode`` (0 plain, 1 add + RMSNorm, 2 SiLU·mul);
    returns ``(y, new_residual)`` (the latter only for mode 1 with a residual). With ``rope``
    ``y`` is the rotated q ``[M, Hq, D]`` and k, v went to the cache. ``out``: where ``y``
    goes (``[M, N]`` of the input's dtype, contiguous rows) instead of a fresh tensor."""
    m = x.shape[0]
    k = x.shape[1] // 2 if mode == PROLOGUE_SILU else x.shape[1]
    n = weight.shape[0]
    assert weight.shape[1] == k and weight.stride(1) == 1, "weight rows must be contiguous"
    if x.stride(1) != 1:
        x = x.contiguous()
    if out is None:
        y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    else:
        assert out.shape == (m, n) and out.dtype == x.dtype and out.stride(1) == 1
        y = out
    new_res = None
    if residual is not None:
        if residual.stride(1) != 1:
            residual = residual.contiguous()
        new_res = torch.empty(m, k, dtype=x.dtype, device=x.device)
    bm, bn, bk, warps = config or pick_config(m, n, k)
    q_out = None
    rope_consts = {}
    if rope is not None:
        hq, hkv, d = rope.num_heads, rope.num_kv_heads, rope.head_dim
        assert n == (hq + 2 * hkv) * d and hq + hkv <= MAX_ROPE_HEADS
        assert rope_fits(rope, (bm, bn, bk, warps)) and rope.k_cache.shape[1] == PAGE_SIZE
        q_out = torch.empty(m, hq, d, dtype=x.dtype, device=x.device)
        rope_consts = dict(ROPE=True, HQ=hq, HKV=hkv, HEAD_DIM=d, PAGE=PAGE_SIZE,
                           HAS_QK_NORM=rope.q_norm_weight is not None)
    chunks = triton.cdiv(k, bk)
    r = residual if residual is not None else x
    o = new_res if new_res is not None else x
    _skinny_kernel[(triton.cdiv(n, bn),)](
        x, r, norm_weight if norm_weight is not None else weight, o, weight,
        bias if bias is not None else weight, y, m, n, eps,
        x.stride(0), r.stride(0), o.stride(0), weight.stride(0), y.stride(0),
        *_rope_args(rope, x, q_out), K=k,
        PROLOGUE=mode, HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EVEN_N=n % bn == 0, EVEN_K=k % bk == 0,
        CHUNKS=chunks, WHOLE=chunks <= MAX_UNROLL, USE_PDL=pdl.ENABLED, num_warps=warps,
        **rope_consts, **pdl.LAUNCH,
    )
    return (y if q_out is None else q_out), new_res


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: tuple[int, int, int, int] | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` ``[M, K]``; the Triton kernel when ``M <= MAX_M``.
    ``out``: the ``[M, N]`` tensor to write it to (returned)."""
    if x.shape[0] > MAX_M or x.shape[0] == 0:
        return _torch_linear(x, weight, bias, out)
    return _launch(PROLOGUE_PLAIN, x, weight, bias, config, out=out)[0]


def _torch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.nn.functional.linear(x, weight, bias)
    if bias is None:
        return torch.mm(x, weight.t(), out=out)
    return torch.addmm(bias, x, weight.t(), out=out)


def skinny_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                       eps: float, weight: torch.Tensor, bias: torch.Tensor | None = None,
                       config: tuple[int, int, int, int] | None = None,
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``new_residual = x + residual`` (``x`` when None), then
    ``rmsnorm(new_residual) * norm_weight @ weight.T + bias``, in one kernel (``M <= MAX_M``);
    returns ``(y, new_residual)``. Each program reads the (tiny) input rows whole anyway, so
    it accumulates their sum of squares in the same pass and scales its sums by ``1/rms`` at
    the end (the normalised input is not rounded to the model dtype first, unlike the
    separate ops: results agree within that rounding). Program 0 writes the new residual."""
    assert 0 < x.shape[0] <= MAX_M
    y, new_res = _launch(PROLOGUE_NORM, x, weight, bias, config, residual, norm_weight, eps)
    return y, (x if new_res is None else new_res)


def skinny_norm_linear_rope(x: torch.Tensor, residual: torch.Tensor | None,
                            norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                            bias: torch.Tensor | None, config: tuple[int, int, int, int],
                            rope: QkvRope) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`skinny_norm_linear` of the qkv projection, then the rotary kernel's work
    (``QkvRope``) in the same launch; returns ``(q, new_residual)`` with the rotated q
    ``[M, Hq, D]``; the rotated k and the v rows are in the cache. ``config`` must satisfy
    :func:`rope_fits`. Results equal the separate projection and rotary kernel: the raw
    projection is rounded to the model dtype before the norm and rotation, as there."""
    assert 0 < x.shape[0] <= MAX_M
    q, new_res = _launch(PROLOGUE_NORM, x, weight, bias, config, residual, norm_weight, eps,
                         rope=rope)
    return q, (x if new_res is None else new_res)


def skinny_silu_linear(gate_up: torch.Tensor, weight: torch.Tensor,
                       config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """``(silu(gate) * up) @ weight.T`` for ``gate_up`` ``[M, 2K]`` (gate first), in one
    kernel (``M <= MAX_M``)."""
    assert 0 < gate_up.shape[0] <= MAX_M
    return _launch(PROLOGUE_SILU, gate_up, weight, None, config)[0]


def skinny_norm_linear_ref(x, residual, norm_weight, eps, weight, bias=None):
    """Torch reference of :func:`skinny_norm_linear` (fp32 accumulation)."""
    new_res = x if residual is None else x + residual
    r32 = new_res.float()
    normed = (r32 * torch.rsqrt(r32.square().mean(-1, keepdim=True) + eps)).to(x.dtype)
    return skinny_linear_ref(norm_weight * normed, weight, bias), new_res


def skinny_silu_linear_ref(gate_up, weight):
    """Torch reference of :func:`skinny_silu_linear` (fp32 accumulation)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return skinny_linear_ref(torch.nn.functional.silu(gate) * up, weight)


def weight_rotation(weight: torch.Tensor) -> list[torch.Tensor]:
    """``weight`` and enough copies of it (at most 16) to exceed twice the L2 cache together:
    timing calls that cycle through them stream their weights from HBM, as a decode step does
    (each layer's weights are read once per step), rather than from L2, as repeats of one
    matrix would. Matrices under an eighth of L2 stay partly L2-resident."""
    l2 = torch.cuda.get_device_properties(weight.device).L2_cache_size
    copies = min(16, -(-2 * l2 // max(1, weight.numel() * weight.element_size())))
    return [weight] + [weight.clone() for _ in range(copies - 1)]


def graph_time_us(fn: Callable[[torch.Tensor], object], weights: Sequence[torch.Tensor],
                  reps: int = 20, trials: int = 3) -> float:
    """Device time of one ``fn(w)`` call: ``reps`` calls captured in one CUDA graph, best of
    ``trials`` replays, so host launch overhead is excluded (as inside a decode graph). The
    calls cycle through ``weights`` (``weight_rotation``: from HBM, not L2)."""
    fn(weights[0])
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with gc_paused(), torch.cuda.graph(g):
        for i in range(reps):
            fn(weights[i % len(weights)])
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(trials):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / reps)
    # Free the graph now: left to the garbage collector, its destructor could run while a
    # later graph is being captured, which invalidates that capture.
    g.reset()
    return best


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """The layers' projections and the LM head: the fastest of cuBLAS and the skinny
    kernel's tile candidates for this shape; written into ``out`` when given.

    The choice is measured on the first call of a shape outside graph capture (graph capture
    warms up eagerly first, so every captured shape is decided before its capture) and kept.
    """
    m = x.shape[0]
    if m > MAX_M or m == 0 or not x.is_cuda:
        return _torch_linear(x, weight, bias, out)
    config = choose(
        ("plain", m, weight.shape[0], weight.shape[1], x.dtype, bias is not None),
        weight,
        unfused=lambda w: _torch_linear(x, w, bias, out),
        fused=lambda cfg, w: skinny_linear(x, w, bias, config=cfg, out=out),
    )
    if config is not None:
        return skinny_linear(x, weight, bias, config=config, out=out)
    return _torch_linear(x, weight, bias, out)


def choose(key: tuple, weight: torch.Tensor, unfused: Callable[[torch.Tensor], object],
           fused: Callable[[tuple[int, int, int, int], torch.Tensor], object]):
    """The skinny-kernel config to use for ``key`` = ``(prologue, m, n, k, dtype, bias)``, or
    None when ``unfused`` (cuBLAS, or the separate prologue op plus ``linear``) is faster.

    Decided on first use outside graph capture by timing ``unfused(w)`` and ``fused(config, w)``
    for every candidate config, each replayed from a CUDA graph (``graph_time_us``: ``w``
    cycles through copies of ``weight``, the projection's weight); then kept in memory
    (``LINEAR_CHOICES``) and on disk. An undecided shape during capture takes ``unfused``.
    """
    choice = LINEAR_CHOICES.get(key)
    if choice is None:
        if torch.cuda.is_current_stream_capturing():
            return None
        choice = _TUNING_CACHE.lookup(key, weight.device)
        if choice is None:
            choice = _tune(key, weight_rotation(weight), unfused, fused)
            _TUNING_CACHE.store(key, weight.device, choice)
        LINEAR_CHOICES[key] = choice
    return choice[0]


@functools.cache
def _kernels_revision() -> str:
    """A digest of what the timings depend on: the Triton sources of the skinny kernel and
    of the separate norm and SiLU·mul kernels the fused prologues are timed against, and the
    tile candidates. An edited kernel invalidates the decisions cached on disk; an edit of
    host code or docs does not."""
    from replaylm.kernels import fused

    digest = hashlib.sha1(repr((CANDIDATES, MAX_UNROLL, MAX_M, TIE)).encode())
    for kernel in (_weight_chunk, _input_chunk, _accumulate, _rope_epilogue, _skinny_kernel,
                   fused._add_rmsnorm_kernel, fused._silu_mul_kernel):
        digest.update(inspect.getsource(kernel.fn).encode())
    return digest.hexdigest()[:12]


class _TuningCache:
    """Decisions of ``choose`` on disk (``$REPLAYLM_CACHE/linear_tuning.json``), per GPU
    model, torch/triton versions, PDL mode (``pdl.mode``) and kernel sources, so a restart
    skips the timing runs."""

    def __init__(self) -> None:
        self.entries: dict[str, list] | None = None

    @staticmethod
    def _path() -> Path:
        from replaylm.model.loader import cache_dir

        return cache_dir() / "linear_tuning.json"

    @staticmethod
    def shape_key(key: tuple) -> str:
        """The shape part of an entry's key: ``kind|MxNxK|dtype|bias``."""
        kind, m, n, k, dtype, bias = key
        return f"{kind}|{m}x{n}x{k}|{dtype}|{bias}"

    @classmethod
    def _key(cls, key: tuple, device: torch.device) -> str:
        gpu = torch.cuda.get_device_name(device)
        return (f"{gpu}|torch {torch.__version__}|triton {triton.__version__}|pdl {pdl.mode()}|"
                f"src {_kernels_revision()}|{cls.shape_key(key)}")

    def decisions_by_shape(self) -> dict[str, tuple[int, int, int, int] | None]:
        """The configs decided for the current kernel sources, on any GPU and versions, by
        ``shape_key`` (None: the unfused path won); for reports made without a GPU."""
        return {"|".join(k.split("|")[-4:]): (tuple(v[0]) if v[0] is not None else None)
                for k, v in self._load().items()}

    def _load(self) -> dict[str, list]:
        if self.entries is None:
            try:
                entries = json.loads(self._path().read_text())
            except (OSError, ValueError):
                entries = {}
            # Decisions made for other kernel sources are stale: dropped on the next save.
            current = f"|src {_kernels_revision()}|"
            self.entries = {k: v for k, v in entries.items() if current in k}
        return self.entries

    def lookup(self, key: tuple, device: torch.device):
        hit = self._load().get(self._key(key, device))
        if hit is None:
            return None
        config, ours, cublas = hit
        return (tuple(config) if config is not None else None), ours, cublas

    def store(self, key: tuple, device: torch.device, choice) -> None:
        entries = self._load()
        entries[self._key(key, device)] = list(choice)
        try:
            path = self._path()
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(entries, indent=0))
            tmp.replace(path)
        except OSError as e:  # a read-only home only costs re-tuning next time
            log.debug("cannot save linear tuning: %s", e)


_TUNING_CACHE = _TuningCache()


def _tune(key: tuple, weights: Sequence[torch.Tensor], unfused: Callable[[torch.Tensor], object],
          fused: Callable[[tuple[int, int, int, int], torch.Tensor], object]):
    """(chosen config or None for the unfused path, its µs, the unfused path's µs).

    Tiles within ``TIE`` of the fastest count as equal, and the one with the fewest warps
    wins: in a decode step a projection's programs launch early (PDL) into whatever SM room
    the kernel before leaves, where lighter programs fit better, which timing one shape
    alone cannot see. (Qwen3-0.6B's o_proj, H200: 4 warps 2.17 µs against 8 warps 2.21 µs
    alone; batch 1 decode 1,500.3-1,501.4 tok/s against 1,484.4-1,486.3 with the 8-warp
    tile, session 9.)"""
    kind, m, n, k = key[:4]
    baseline = graph_time_us(unfused, weights)
    timed = [(cfg, graph_time_us(lambda w, cfg=cfg: fused(cfg, w), weights))
             for cfg in candidate_configs(m, k)]
    fastest = min(us for _, us in timed)
    best, best_us = min(((cfg, us) for cfg, us in timed if us <= fastest * (1 + TIE)),
                        key=lambda c: (c[0][3], c[1]))
    if best_us >= baseline:
        best, best_us = None, baseline
    log.info("%s linear %dx%dx%d: unfused %.2f us, best %s %.2f us", kind, m, n, k, baseline,
             "unfused" if best is None else f"triton {best}", best_us)
    return best, round(best_us, 2), round(baseline, 2)
