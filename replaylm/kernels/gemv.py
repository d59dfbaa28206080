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

Neither wins everywhere (measured on the H200, launch overhead excluded: on Qwen3-0.6B's
o_proj, 1024x2048, cuBLAS takes 12.4 µs and this kernel 3.9 µs; on Llama-3.2-1B's gate_up,
16384x2048, cuBLAS 18.2 µs and this kernel 25 µs). So ``linear``, what the model's layers
call, times both once per shape on the device, each replayed from a CUDA graph, and keeps the
faster; ``LINEAR_CHOICES`` records every decision.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import triton
import triton.language as tl

log = logging.getLogger(__name__)

MAX_M = 8  # above this, cuBLAS' tensor-core tiles win

#: (m, n, k, dtype, has_bias) -> (use the Triton kernel, its µs, cuBLAS µs), per process.
LINEAR_CHOICES: dict[tuple, tuple[bool, float, float]] = {}


def skinny_linear_ref(x: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    y = x.float() @ weight.float().t()
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, stride_xm, stride_wn, stride_ym,
                   K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # K is a compile-time constant: a model has a few
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :],
                    mask=n_mask[:, None] & k_mask[None, :], other=0.0,
                    eviction_policy="evict_first").to(tl.float32)  # [BN, BK]
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)  # [BM, BK]
        acc += tl.sum(w[None, :, :] * x[:, None, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def pick_config(m: int, n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps): enough weight strips to cover the SMs a few
    times over, and a per-thread tile that stays in registers."""
    block_m = triton.next_power_of_2(max(m, 1))
    block_n = 16
    while block_n > 4 and triton.cdiv(n, block_n) < 256:
        block_n //= 2
    block_k = max(64, min(512, 8192 // (block_m * block_n)))
    block_k = min(block_k, triton.next_power_of_2(k))
    return block_m, block_n, block_k, 4


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` ``[M, K]``; the Triton kernel when ``M <= MAX_M``."""
    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_M or m == 0:
        return torch.nn.functional.linear(x, weight, bias)
    if x.stride(1) != 1:
        x = x.contiguous()
    assert weight.stride(1) == 1, "weight rows must be contiguous"
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    bm, bn, bk, warps = config or pick_config(m, n, k)
    _skinny_kernel[(triton.cdiv(n, bn),)](
        x, weight, bias if bias is not None else weight, y, m, n,
        x.stride(0), weight.stride(0), y.stride(0), K=k,
        HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
    )
    return y


def graph_time_us(fn: Callable[[], object], reps: int = 20, trials: int = 3) -> float:
    """Device time of one ``fn()`` call: ``reps`` calls captured in one CUDA graph, best of
    ``trials`` replays, so host launch overhead is excluded (as inside a decode graph)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
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


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The layers' projection: the faster of cuBLAS and the skinny kernel for this shape.

    The choice is measured on the first call of a shape outside graph capture (graph capture
    warms up eagerly first, so every captured shape is decided before its capture) and kept.
    """
    m = x.shape[0]
    if m > MAX_M or m == 0 or not x.is_cuda:
        return torch.nn.functional.linear(x, weight, bias)
    key = (m, weight.shape[0], weight.shape[1], x.dtype, bias is not None)
    choice = LINEAR_CHOICES.get(key)
    if choice is None:
        if torch.cuda.is_current_stream_capturing():
            return torch.nn.functional.linear(x, weight, bias)  # undecided: the safe default
        ours = graph_time_us(lambda: skinny_linear(x, weight, bias))
        cublas = graph_time_us(lambda: torch.nn.functional.linear(x, weight, bias))
        choice = LINEAR_CHOICES[key] = (ours < cublas, round(ours, 2), round(cublas, 2))
        log.info("linear %dx%dx%d: triton %.2f us, cublas %.2f us -> %s", m, key[1], key[2],
                 ours, cublas, "triton" if choice[0] else "cublas")
    if choice[0]:
        return skinny_linear(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)
