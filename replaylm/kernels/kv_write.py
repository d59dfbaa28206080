"""Store the new tokens' K/V into the paged cache, driven by ``slot_mapping``.

One program per token copies all of its KV heads; padded tokens carry a slot in scratch
block 0 (``replaylm.batch``), so they write harmlessly and need no branch. A negative slot is also
skipped, which lets callers mark tokens that must not write at all.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replaylm.batch import BLOCK_SIZE


@triton.jit(do_not_specialize=["num_tokens"])
def _kv_write_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, num_tokens,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    NUM_KV_HEADS: tl.constexpr, H_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    blk = slot // PAGE
    off = slot % PAGE
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, HEAD_DIM)
    mask = (h < NUM_KV_HEADS)[:, None]
    k = tl.load(k_ptr + tok * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + tok * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    kc = k_cache_ptr + blk * stride_kcb + off * stride_kcs + h[:, None] * stride_kch + d[None, :]
    vc = v_cache_ptr + blk * stride_vcb + off * stride_vcs + h[:, None] * stride_vch + d[None, :]
    tl.store(kc, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``k``/``v`` ``[T, Hkv, D]`` (any token/head strides, contiguous last dim) into
    caches ``[num_blocks, 16, Hkv, D]`` at ``slot_mapping`` ``[T]``; no host sync."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k.stride(-1) == 1 and v.stride(-1) == 1
    assert k_cache.shape[1] == BLOCK_SIZE and k_cache.shape[2:] == (num_kv_heads, head_dim)
    _kv_write_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, num_tokens,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, H_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, PAGE=BLOCK_SIZE, num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )
