"""Skinny matmul for decode: ``y = x @ W^T (+ b)`` with few rows in ``x`` (batch-1 decode).

At one to a few tokens a projection is a pure weight stream: every weight byte is read once
and used ``M`` times. This kernel gives each program a strip of ``BLOCK_N`` weight rows and
the whole ``K``: it streams the strip in ``BLOCK_K`` chunks, multiplies each chunk by all
``M`` rows of ``x`` and reduces in fp32. Split-K tiles (``kernels.skinny_split``) give each
program one range of ``K`` and add the ranges' fp32 partials in a second launch, in a fixed
order. No atomics, so graph replays and their eager re-runs agree to the bit.

Launches saved: ``skinny_norm_linear`` folds the residual add + RMSNorm in front of a
projection (each program sums the squares of its input rows as it streams them and scales
its sums by 1/rms; program 0 stores the new residual), ``skinny_silu_linear`` folds
SiLU(gate)·up in front of down_proj, and ``silu_pairs`` puts it behind gate_up instead: each
program takes gate rows and the up rows that pair with them and stores ``silu(g) * u``.

FP8 weights (``float8_e4m3fn`` with one float32 scale per output row, ``ref.quantize_fp8``)
run through the same kernel: the one-byte weights stream in chunks twice as long in ``K``
(``CANDIDATES_FP8``: 16 bytes per thread per load, as with bf16), are converted to fp32 in
registers, and each output's sum is multiplied by its row's scale in the epilogue. The
product is fp32 FMAs throughout (no tensor cores), so an fp32 model stays fp32.

Which tile runs, and whether this kernel beats cuBLAS (or the separate prologue op) at a
shape at all, is measured by ``kernels.tuner``; ``kernels.ops`` uses the result. The torch
references are ``kernels.ref.linear`` / ``norm_linear`` / ``silu_linear``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from contextvars import ContextVar

import torch
import triton
import triton.language as tl

from replaylm.kernels import launch_bytes, pdl, ref, skinny_split
from replaylm.kernels.pdl import wait_for_previous
from replaylm.kernels.skinny_epilogue import _epilogue, _store_silu_pairs

MAX_M = 8  # above this, cuBLAS' tensor-core tiles win
#: What the kernel computes on its input rows before the product (``_skinny_kernel``).
PROLOGUE_PLAIN, PROLOGUE_NORM, PROLOGUE_SILU = 0, 1, 2
#: K chunks up to which a strip is loaded whole before the PDL wait (``_load_strip``).
MAX_UNROLL = 4
#: Set inside :func:`compile_only`: ``_launch`` compiles its kernel and does not run it.
_COMPILE_ONLY: ContextVar[bool] = ContextVar("skinny_compile_only", default=False)


@triton.jit
def _weight_chunk(w_ptrs, k0, n_mask, cols, K: tl.constexpr, EVEN_N: tl.constexpr,
                  EVEN_K: tl.constexpr):
    if EVEN_N and EVEN_K:
        return tl.load(w_ptrs + k0, eviction_policy="evict_first")
    return tl.load(w_ptrs + k0, mask=n_mask[None, :, None] & ((k0 + cols) < K)[None, None, :],
                   other=0.0,
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
    return acc + w.to(tl.float32) * x[:, None, :], sq + sq_k


@triton.jit
def _load_strip(w_ptr, offs_n, n_mask, cols, k_base, stride_wn, K: tl.constexpr,
                BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
                CHUNKS: tl.constexpr, WHOLE: tl.constexpr):
    """Pointers to a program's weight strip (``[1, BLOCK_N, BLOCK_K]``, first chunk) and its
    first chunks: all (up to ``MAX_UNROLL``) when ``WHOLE``, else one. Weights are never
    written by an earlier kernel, so this runs before the PDL wait: the weight stream overlaps
    the previous kernel, and only the input rows are read after it. A longer strip streams
    the rest in ``_strip_sums`` (unrolling 16-56 chunks multiplies compile and tuning time).

    The strip is loaded as a 3-D tensor, in the layout the products use: each thread's 16
    bytes of a chunk stay in its registers from the load to the FMAs (a 2-D strip broadcast
    to 3-D afterwards went through shared memory, a store and a load per weight)."""
    w_ptrs = w_ptr + offs_n[None, :, None] * stride_wn + cols[None, None, :]
    w0 = _weight_chunk(w_ptrs, k_base, n_mask, cols, K, EVEN_N, EVEN_K)
    w1 = w0  # placeholders; chunks past the strip's end are never used
    w2 = w0
    w3 = w0
    if WHOLE and CHUNKS > 1:
        w1 = _weight_chunk(w_ptrs, k_base + BLOCK_K, n_mask, cols, K, EVEN_N, EVEN_K)
    if WHOLE and CHUNKS > 2:
        w2 = _weight_chunk(w_ptrs, k_base + 2 * BLOCK_K, n_mask, cols, K, EVEN_N, EVEN_K)
    if WHOLE and CHUNKS > 3:
        w3 = _weight_chunk(w_ptrs, k_base + 3 * BLOCK_K, n_mask, cols, K, EVEN_N, EVEN_K)
    return w_ptrs, w0, w1, w2, w3


@triton.jit
def _strip_sums(w_ptrs, w0, w1, w2, w3, n_mask, k_base, k_end, x_ptr, r_ptr, nw_ptr, res_out_ptr,
                offs_m, m_mask, cols, store_residual, stride_xm, stride_rm, stride_om,
                K: tl.constexpr, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, CHUNKS: tl.constexpr,
                WHOLE: tl.constexpr):
    """The strip's fp32 sums ``[BLOCK_M, BLOCK_N]`` over columns ``k_base..k_end`` of the
    input rows (after the prologue), and (RMSNorm prologue) the rows' sums of squares; the
    chunks ``_load_strip`` loaded first, the rest streamed here."""
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + cols[None, :]
    r_ptrs = r_ptr + offs_m[:, None] * stride_rm + cols[None, :]
    out_ptrs = res_out_ptr + offs_m[:, None] * stride_om + cols[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc, sq = _accumulate(acc, sq, w0, k_base, x_ptrs, r_ptrs, nw_ptr, out_ptrs, m_mask, cols,
                          store_residual, K, BLOCK_M, PROLOGUE, HAS_RESIDUAL, EVEN_K)
    if WHOLE:
        if CHUNKS > 1:
            acc, sq = _accumulate(acc, sq, w1, k_base + BLOCK_K, x_ptrs, r_ptrs, nw_ptr,
                                  out_ptrs, m_mask, cols, store_residual, K, BLOCK_M,
                                  PROLOGUE, HAS_RESIDUAL, EVEN_K)
        if CHUNKS > 2:
            acc, sq = _accumulate(acc, sq, w2, k_base + 2 * BLOCK_K, x_ptrs, r_ptrs, nw_ptr,
                                  out_ptrs, m_mask, cols, store_residual, K, BLOCK_M,
                                  PROLOGUE, HAS_RESIDUAL, EVEN_K)
        if CHUNKS > 3:
            acc, sq = _accumulate(acc, sq, w3, k_base + 3 * BLOCK_K, x_ptrs, r_ptrs, nw_ptr,
                                  out_ptrs, m_mask, cols, store_residual, K, BLOCK_M,
                                  PROLOGUE, HAS_RESIDUAL, EVEN_K)
    else:
        for k0 in range(k_base + BLOCK_K, k_end, BLOCK_K):
            w = _weight_chunk(w_ptrs, k0, n_mask, cols, K, EVEN_N, EVEN_K)
            acc, sq = _accumulate(acc, sq, w, k0, x_ptrs, r_ptrs, nw_ptr, out_ptrs, m_mask,
                                  cols, store_residual, K, BLOCK_M, PROLOGUE, HAS_RESIDUAL,
                                  EVEN_K)
    return tl.sum(acc, axis=2), sq


@triton.jit
def _skinny_kernel(x_ptr, r_ptr, nw_ptr, res_out_ptr, w_ptr, s_ptr, b_ptr, y_ptr, part_ptr, M, N,
                   eps, stride_xm, stride_rm, stride_om, stride_wn, stride_ym,
                   K: tl.constexpr, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                   HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr,
                   EVEN_K: tl.constexpr, CHUNKS: tl.constexpr, WHOLE: tl.constexpr,
                   SPLIT_K: tl.constexpr, USE_PDL: tl.constexpr, SILU_PAIRS: tl.constexpr):
    pid = tl.program_id(0)
    if SILU_PAIRS:
        # [gate | up] weights (N = 2I): gate rows pid*H.. and the up rows I + pid*H.. pair
        # up in one strip, H = BLOCK_N / 2.
        pair = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N) % (BLOCK_N // 2)
        offs_n = tl.where(tl.arange(0, BLOCK_N) < BLOCK_N // 2, pair, pair + N // 2)
        n_mask = pair < N // 2
    else:
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    # Split-K: program (pid, s) takes the CHUNKS chunks from column s * CHUNKS * BLOCK_K on
    # (chunks past K are masked off); otherwise one program streams the whole K.
    if SPLIT_K > 1:
        k_base = tl.program_id(1) * (CHUNKS * BLOCK_K)
        k_end = tl.minimum(k_base + CHUNKS * BLOCK_K, K)
    else:
        k_base = 0
        k_end = K
    w_ptrs, w0, w1, w2, w3 = _load_strip(w_ptr, offs_n, n_mask, cols, k_base, stride_wn, K,
                                         BLOCK_K, EVEN_N, EVEN_K, CHUNKS, WHOLE)
    wait_for_previous(USE_PDL)
    # One program per K range writes the new residual (each split owns its columns).
    out, sq = _strip_sums(w_ptrs, w0, w1, w2, w3, n_mask, k_base, k_end, x_ptr, r_ptr, nw_ptr,
                          res_out_ptr, offs_m, m_mask, cols, pid == 0, stride_xm, stride_rm,
                          stride_om, K, PROLOGUE, HAS_RESIDUAL, BLOCK_M, BLOCK_N, BLOCK_K,
                          EVEN_N, EVEN_K, CHUNKS, WHOLE)
    if SPLIT_K > 1:
        # fp32 partial sums (and, for the norm, the range's sums of squares) for
        # ``skinny_split._reduce_kernel``, which finishes the epilogue.
        split = tl.program_id(1)
        tl.store(part_ptr + (split * BLOCK_M + offs_m[:, None]) * N + offs_n[None, :], out,
                 mask=n_mask[None, :])
        if PROLOGUE == 1:
            if pid == 0:
                tl.store(part_ptr + SPLIT_K * BLOCK_M * N + split * BLOCK_M + offs_m, sq)
    else:
        out = _epilogue(out, sq, s_ptr, b_ptr, offs_n, n_mask, eps, K, PROLOGUE, HAS_SCALE,
                        HAS_BIAS)
        if SILU_PAIRS:
            _store_silu_pairs(out, y_ptr, offs_m, m_mask, pid, N // 2, stride_ym, BLOCK_M,
                              BLOCK_N)
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
#: The candidates for one-byte (FP8) weights: the same strips twice as long in ``K``, so a
#: thread's share of a chunk is as many bytes (16 per load) as with two-byte weights.
CANDIDATES_FP8: dict[int, list[tuple[int, int, int]]] = {
    bm: [(bn, 2 * bk, warps) for bn, bk, warps in cands] for bm, cands in CANDIDATES.items()}


def _candidates(weight_dtype: torch.dtype | None) -> dict[int, list[tuple[int, int, int]]]:
    fp8 = weight_dtype is not None and weight_dtype.itemsize == 1
    return CANDIDATES_FP8 if fp8 else CANDIDATES


def candidate_configs(m: int, k: int, weight_dtype: torch.dtype | None = None,
                      ) -> list[tuple[int, ...]]:
    """Every tile the tuner times for ``m`` rows, reduction length ``k`` and weights of
    ``weight_dtype``: ``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps)`` from ``CANDIDATES`` (or
    ``CANDIDATES_FP8`` for one-byte weights), with ``BLOCK_K`` capped at ``k``'s next power
    of two; then the split-K tiles ``(..., SPLIT_K)`` of ``skinny_split`` whose ``k`` holds
    at least two ranges (``SPLIT_K``: the ranges ``split_chunks`` cuts)."""
    bm = triton.next_power_of_2(m)
    kp = triton.next_power_of_2(k)
    tiles: list[tuple[int, ...]] = [(bm, bn, min(bk, kp), warps)
                                    for bn, bk, warps in _candidates(weight_dtype)[bm]]
    fp8 = weight_dtype is not None and weight_dtype.itemsize == 1
    split = skinny_split.SPLIT_CANDIDATES_FP8 if fp8 else skinny_split.SPLIT_CANDIDATES
    for bn, bk, warps, splits in split.get(bm, ()):
        ranges = skinny_split.split_chunks(k, bk, splits)[1]
        if ranges > 1:
            tiles.append((bm, bn, bk, warps, ranges))
    return tiles


def pick_config(m: int, n: int, k: int, weight_dtype: torch.dtype | None = None,
                ) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) without measuring: the first candidate whose
    strips cover the SMs about twice."""
    block_m = triton.next_power_of_2(max(m, 1))
    cands = _candidates(weight_dtype)[min(block_m, 8)]
    for bn, bk, warps in cands:
        if triton.cdiv(n, bn) >= 256:
            return block_m, bn, min(bk, triton.next_power_of_2(k)), warps
    bn, bk, warps = min(cands)
    return block_m, bn, min(bk, triton.next_power_of_2(k)), warps


@contextlib.contextmanager
def compile_only() -> Iterator[None]:
    """Within this context the skinny-kernel calls compile their kernel (Triton ``warmup``)
    and launch nothing; their outputs are left unwritten. Inside ``triton.AsyncCompileMode``
    the compiles then run on that mode's executor (``kernels.tuner.precompile``)."""
    token = _COMPILE_ONLY.set(True)
    try:
        yield
    finally:
        _COMPILE_ONLY.reset(token)


def _launch(mode: int, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            config: tuple[int, ...] | None, residual: torch.Tensor | None = None,
            norm_weight: torch.Tensor | None = None, eps: float = 0.0,
            out: torch.Tensor | None = None, scale: torch.Tensor | None = None,
            kernel: triton.runtime.JITFunction | None = None, extra: dict | None = None,
            silu_pairs: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the skinny kernel with prologue ``mode`` (0 plain, 1 add + RMSNorm, 2 SiLU·mul);
    returns ``(y, new_residual)`` (the latter only for mode 1 with a residual). ``out``: where
    ``y`` goes (``[M, N]``, contiguous rows). ``scale``: the float32 row scales ``[N]`` of an
    FP8 ``weight``. ``config``: ``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps)``, or with a fifth
    entry ``SPLIT_K`` > 1 a split-K launch (``skinny_split``). ``kernel``: a variant of
    ``_skinny_kernel`` taking its arguments and ``extra`` ones (whole-K tiles only).
    ``silu_pairs``: ``weight`` is ``[gate | up]`` and ``y`` is ``silu(gate) * up``, ``[M, N/2]``
    (whole-K tiles only). Each launch's bytes go to ``launch_bytes``."""
    m = x.shape[0]
    k = x.shape[1] // 2 if mode == PROLOGUE_SILU else x.shape[1]
    n = weight.shape[0]
    assert weight.shape[1] == k and weight.stride(1) == 1, "weight rows must be contiguous"
    assert scale is None or (scale.shape == (n,) and scale.dtype == torch.float32
                             and scale.stride(0) == 1), "scale must be float32 [N]"
    if x.stride(1) != 1:
        x = x.contiguous()
    n_out = n // 2 if silu_pairs else n
    if out is None:
        y = torch.empty(m, n_out, dtype=x.dtype, device=x.device)
    else:
        assert out.shape == (m, n_out) and out.dtype == x.dtype and out.stride(1) == 1
        y = out
    new_res = None
    if residual is not None:
        if residual.stride(1) != 1:
            residual = residual.contiguous()
        new_res = torch.empty(m, k, dtype=x.dtype, device=x.device)
    bm, bn, bk, warps, *rest = config or pick_config(m, n, k, weight.dtype)
    if bm < m:
        raise ValueError(f"skinny tile {config} has BLOCK_M={bm} < {m} rows")
    chunks, splits = triton.cdiv(k, bk), 1
    if rest and rest[0] > 1:
        chunks, splits = skinny_split.split_chunks(k, bk, rest[0])
    assert (kernel is None and not silu_pairs) or splits == 1, "whole-K tiles only"
    assert not silu_pairs or (n % 2 == 0 and bn >= 2)
    part = skinny_split.partials(splits, bm, n, x.device) if splits > 1 else y
    r = residual if residual is not None else x
    o = new_res if new_res is not None else x
    grid = (triton.cdiv(n_out, bn // 2) if silu_pairs else triton.cdiv(n, bn), splits)
    compile_only = _COMPILE_ONLY.get()
    fn = kernel or _skinny_kernel
    launch = functools.partial(fn.warmup, grid=grid) if compile_only else fn[grid]
    if not compile_only:
        launch_bytes.record(fn.__name__, grid, launch_bytes.moved(x, weight, scale, y, new_res))
    launch(
        x, r, norm_weight if norm_weight is not None else weight, o, weight,
        scale if scale is not None else weight, bias if bias is not None else weight, y, part,
        m, n, eps,
        x.stride(0), r.stride(0), o.stride(0), weight.stride(0), y.stride(0),
        K=k,
        PROLOGUE=mode, HAS_RESIDUAL=residual is not None, HAS_SCALE=scale is not None,
        HAS_BIAS=bias is not None,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        EVEN_N=n_out % (bn // 2) == 0 if silu_pairs else n % bn == 0,
        EVEN_K=k % bk == 0 and chunks * splits * bk == k,
        CHUNKS=chunks, WHOLE=chunks <= MAX_UNROLL, SPLIT_K=splits, USE_PDL=pdl.ENABLED,
        SILU_PAIRS=silu_pairs, num_warps=warps, **(extra or {}), **pdl.LAUNCH,
    )
    if splits > 1:
        skinny_split.reduce_splits(part, scale, bias, y, m, k, splits, bm,
                                   mode == PROLOGUE_NORM, eps, compile_only)
    return y, new_res


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: tuple[int, ...] | None = None,
                  out: torch.Tensor | None = None, scale: torch.Tensor | None = None,
                  silu_pairs: bool = False) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` ``[M, K]``; the Triton kernel when ``M <= MAX_M``.
    ``out``: the ``[M, N]`` tensor to write it to (returned). ``scale``: the per-row scales
    of an FP8 ``weight``. ``silu_pairs``: ``silu_and_mul`` of it, in the same launch."""
    if x.shape[0] > MAX_M or x.shape[0] == 0:
        y = ref.linear(x, weight, bias, None if silu_pairs else out, scale=scale)
        return ref.silu_and_mul(y) if silu_pairs else y
    return _launch(PROLOGUE_PLAIN, x, weight, bias, config, out=out, scale=scale,
                   silu_pairs=silu_pairs)[0]


def skinny_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                       eps: float, weight: torch.Tensor, bias: torch.Tensor | None = None,
                       config: tuple[int, ...] | None = None,
                       scale: torch.Tensor | None = None, silu_pairs: bool = False,
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``new_residual = x + residual`` (``x`` when None), then
    ``rmsnorm(new_residual) * norm_weight @ weight.T + bias``, in one kernel (``M <= MAX_M``);
    returns ``(y, new_residual)``. Each program reads the (tiny) input rows whole anyway, so
    it accumulates their sum of squares in the same pass and scales its sums by ``1/rms`` at
    the end (the normalised input is not rounded to the model dtype first, unlike the
    separate ops: results agree within that rounding). Program 0 writes the new residual.
    ``silu_pairs``: as for ``skinny_linear``."""
    assert 0 < x.shape[0] <= MAX_M
    y, new_res = _launch(PROLOGUE_NORM, x, weight, bias, config, residual, norm_weight, eps,
                         scale=scale, silu_pairs=silu_pairs)
    return y, (x if new_res is None else new_res)


def skinny_silu_linear(gate_up: torch.Tensor, weight: torch.Tensor,
                       config: tuple[int, ...] | None = None,
                       scale: torch.Tensor | None = None) -> torch.Tensor:
    """``(silu(gate) * up) @ weight.T`` for ``gate_up`` ``[M, 2K]`` (gate first), in one
    kernel (``M <= MAX_M``)."""
    assert 0 < gate_up.shape[0] <= MAX_M
    return _launch(PROLOGUE_SILU, gate_up, weight, None, config, scale=scale)[0]
