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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_M = 8  # above this, cuBLAS' tensor-core tiles win


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
