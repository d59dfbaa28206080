"""Dense ops of the decoder, as torch references.

The numerics follow transformers' Llama/Qwen modules (RMSNorm in fp32, rotary in the model
dtype) so fp32 runs match the reference exactly and bf16 runs within tolerance. On CUDA the
model may swap in fused Triton kernels with the same signatures (``replaylm.kernels.fused``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def split_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views of the fused qkv projection ``[T, (Hq + 2 Hkv) D]`` as q ``[T, Hq, D]``, k and v
    ``[T, Hkv, D]``."""
    t = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    return (q.view(t, num_heads, head_dim), k.view(t, num_kv_heads, head_dim),
            v.view(t, num_kv_heads, head_dim))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual += x`` then normalise; returns ``(normed, new_residual)``."""
    residual = x if residual is None else residual + x
    return rms_norm(residual, weight, eps), residual


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def apply_rotary(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotary on ``[T, H, D]`` (rotate the two halves), as HF Llama does."""
    half = x.shape[-1] // 2
    cs = cos_sin[positions].to(x.dtype)  # [T, D]: cos | sin, each D/2
    cos = torch.cat([cs[:, :half], cs[:, :half]], -1)[:, None, :]
    sin = torch.cat([cs[:, half:], cs[:, half:]], -1)[:, None, :]
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


linear = F.linear


def norm_linear(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
    weight: torch.Tensor, bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add + RMSNorm, then a projection; returns ``(projection, new_residual)``."""
    normed, residual = add_rms_norm(x, residual, norm_weight, eps)
    return F.linear(normed, weight, bias), residual


def silu_linear(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """SiLU-and-mul, then a projection (down_proj)."""
    return F.linear(silu_and_mul(gate_up), weight)
