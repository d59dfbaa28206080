"""The skinny projection's epilogues (``kernels.skinny``): the whole-K sums finished (the
norm's 1/rms, FP8 row scales, bias), and the store of ``silu(gate) * up`` for a strip of
paired gate and up rows."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _epilogue(out, sq, s_ptr, b_ptr, offs_n, n_mask, eps, K: tl.constexpr,
              PROLOGUE: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The whole-K sums ``out`` with the norm's 1/rms, the FP8 row scales and the bias
    applied (fp32)."""
    if PROLOGUE == 1:
        # sum_k w[n,k] * (s[k] * rstd) * g[k] == rstd * sum_k w[n,k] * s[k] * g[k]: the
        # row scale leaves the sum, so one pass serves both the norm and the product.
        out = out * tl.rsqrt(sq / K + eps)[:, None]
    if HAS_SCALE:  # FP8 weights: each row's scale leaves the sum the same way
        out = out * tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        out += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    return out


@triton.jit
def _store_silu_pairs(out, y_ptr, offs_m, m_mask, pid, inter, stride_ym, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr):
    """Store ``silu(gate) * up`` of a paired strip's sums (gate half, then up half): each
    rounded to the model dtype first, as the stored projection would be, then as
    ``elementwise.silu_and_mul`` computes it, so the bits are the same as the two launches'."""
    dt = y_ptr.dtype.element_ty
    g, u = tl.split(tl.permute(tl.reshape(out, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
    g = g.to(dt).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    cols = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + cols[None, :],
             (act * u.to(dt).to(tl.float32)).to(dt), mask=m_mask[:, None] & (cols < inter)[None, :])
