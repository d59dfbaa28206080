"""Split-K for the skinny matmul (``kernels.skinny``): the reduction pass and its tiles.

A projection with few output rows per SM (Llama 3 8B's o_proj: 4096 rows of 4096 FP8
bytes, 16 MB) leaves the SMs short of weight loads in flight when each program streams a
whole row strip: too few programs for 132 SMs, or programs that spend their time on one
long strip. A split-K tile ``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, SPLIT_K)`` cuts ``K``
into ``SPLIT_K`` equal ranges of whole ``BLOCK_K`` chunks; program ``(n, s)`` of
``_skinny_kernel`` streams strip ``n`` over range ``s`` and writes its fp32 sums to a
partials buffer, and :func:`reduce_splits` (a second, tiny launch) adds each output's
partials in split order and finishes the epilogue: the norm's 1/rms, the FP8 row scale, the
bias and the cast. No atomics, so a graph replay and its eager re-run agree bit for bit.

Prologues under split-K: SiLU·mul is elementwise in ``K``, so each program computes its
range's inputs itself. The RMSNorm needs each row's sum of squares over the *whole* row,
but 1/rms is a per-row factor that leaves the sum (``sum_k w·s·g·rstd = rstd·sum_k w·s·g``),
so each program sums the squares of its own range only; the programs of strip 0 store
those per-range sums beside the partials, and the reduction adds them (in split order)
before applying 1/rms. The new residual is written by strip 0's programs, each its range.

The partials buffer (``[SPLIT_K, BLOCK_M, N]`` fp32 plus ``[SPLIT_K, BLOCK_M]`` for the
sums of squares) is taken from PyTorch's caching allocator on the launching stream, as the
output is: under CUDA graph capture that is a fixed address in the graph's pool, the same
on every replay, and two projections on concurrent streams (an MoE shared expert beside the
router) never share one. Both kernels write only after their PDL wait, so a buffer reused
by the next projection is never written while the previous reduction still reads it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replaylm.kernels import pdl
from replaylm.kernels.pdl import wait_for_previous

#: Split-K tiles ``(BLOCK_N, BLOCK_K, num_warps, SPLIT_K)`` per row-block size, bf16
#: weights; the tuner times them beside ``skinny.CANDIDATES``. A strip twice as wide as the
#: whole-K tiles' over two ranges of ``K``, in the same register budget. None at one row:
#: on the H200 no split tile beat a whole-K one at m = 1 on any Llama-3-8B projection (FP8
#: or bf16, ``benchmarks/fp8.py gemv``), while this one won by up to 11% at two rows (FP8
#: qkv, gate_up, lm_head) and 3% at four (bf16 down); wider splits never won.
SPLIT_CANDIDATES: dict[int, list[tuple[int, int, int, int]]] = {
    2: [(8, 256, 4, 2)],
    4: [(8, 128, 4, 2)],
    8: [(4, 128, 4, 2)],
}
#: The split-K tiles for one-byte (FP8) weights: chunks twice as long in ``K``.
SPLIT_CANDIDATES_FP8: dict[int, list[tuple[int, int, int, int]]] = {
    bm: [(bn, 2 * bk, warps, splits) for bn, bk, warps, splits in cands]
    for bm, cands in SPLIT_CANDIDATES.items()}
#: Output columns per program of the reduction pass.
REDUCE_BLOCK_N = 128


def split_chunks(k: int, block_k: int, splits: int) -> tuple[int, int]:
    """``(chunks per range, ranges)`` for cutting ``k`` into about ``splits`` ranges of whole
    ``block_k`` chunks: the ranges that hold at least one chunk."""
    chunks = triton.cdiv(k, block_k)
    per = triton.cdiv(chunks, splits)
    return per, triton.cdiv(chunks, per)


def partials(splits: int, block_m: int, n: int, device: torch.device) -> torch.Tensor:
    """The fp32 partials buffer of a split-K launch: ``[splits, block_m, n]`` sums, then
    ``[splits, block_m]`` sums of squares (the norm prologue's)."""
    return torch.empty(splits * block_m * (n + 1), dtype=torch.float32, device=device)


@triton.jit
def _reduce_kernel(part_ptr, s_ptr, b_ptr, y_ptr, M, N, K, eps, stride_ym,
                   SPLIT_K: tl.constexpr, PROLOGUE: tl.constexpr, HAS_SCALE: tl.constexpr,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   USE_PDL: tl.constexpr):
    """The split-K epilogue: sums the ``SPLIT_K`` fp32 partials of each output in split
    order (so the result does not depend on which split finished first), then applies the
    norm's 1/rms (from the summed sums of squares), the FP8 row scale and the bias, and
    stores in the output's dtype."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    scale = tl.zeros((BLOCK_N,), dtype=tl.float32)
    bias = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if HAS_SCALE:  # weights: written by no kernel of the step, so read before the wait
        scale = tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    wait_for_previous(USE_PDL)
    out = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        out += tl.load(part_ptr + (s * BLOCK_M + offs_m[:, None]) * N + offs_n[None, :],
                       mask=n_mask[None, :], other=0.0)
    if PROLOGUE == 1:
        sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):
            sq += tl.load(part_ptr + SPLIT_K * BLOCK_M * N + s * BLOCK_M + offs_m)
        out = out * tl.rsqrt(sq / K + eps)[:, None]
    if HAS_SCALE:
        out = out * scale[None, :]
    if HAS_BIAS:
        out += bias[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
             out.to(y_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & n_mask[None, :])


def reduce_splits(part: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None,
                  y: torch.Tensor, m: int, k: int, splits: int, block_m: int, norm: bool,
                  eps: float, compile_only: bool = False) -> None:
    """Finish a split-K launch into ``y`` ``[m, N]``: the partials summed in split order,
    then 1/rms (``norm``), the row ``scale`` and ``bias``. ``compile_only``: compile the
    kernel (Triton ``warmup``) and launch nothing."""
    n = y.shape[1]
    grid = (triton.cdiv(n, REDUCE_BLOCK_N),)
    kernel = _reduce_kernel.warmup if compile_only else _reduce_kernel[grid]
    extra = {"grid": grid} if compile_only else {}
    kernel(part, scale if scale is not None else part, bias if bias is not None else part, y,
           m, n, k, eps, y.stride(0), SPLIT_K=splits, PROLOGUE=1 if norm else 0,
           HAS_SCALE=scale is not None, HAS_BIAS=bias is not None, BLOCK_M=block_m,
           BLOCK_N=REDUCE_BLOCK_N, USE_PDL=pdl.ENABLED, num_warps=4, **extra, **pdl.LAUNCH)
