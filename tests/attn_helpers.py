"""A front-packed paged attention batch for the kernel tests (CPU interpreter and GPU)."""

from __future__ import annotations

import torch

from replaylm.batch import BLOCK_SIZE, AttentionMetadata


def make_batch(q_lens, kv_lens, *, hq, hkv, d, pad_tokens=0, pad_slots=0, seed=0,
               dtype=torch.float32, device="cpu"):
    """A front-packed, padded batch with a randomly paged cache (block 0 left as scratch)."""
    g = torch.Generator().manual_seed(seed)
    blocks_per = [(n + BLOCK_SIZE - 1) // BLOCK_SIZE for n in kv_lens]
    num_blocks = 1 + sum(blocks_per)
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    max_blocks = max(blocks_per + [1])
    s = len(q_lens) + pad_slots
    block_table = torch.zeros(s, max_blocks, dtype=torch.int32)
    for i, nb in enumerate(blocks_per):
        block_table[i, :nb] = torch.tensor(perm[:nb], dtype=torch.int32)
        perm = perm[nb:]
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, hkv, d, generator=g).to(dtype)
    t_real = sum(q_lens)
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    cu += [t_real] * pad_slots
    kv = list(kv_lens) + [0] * pad_slots
    q = torch.randn(t_real + pad_tokens, hq, d, generator=g).to(dtype)
    meta = AttentionMetadata(
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        kv_lens=torch.tensor(kv, dtype=torch.int32, device=device),
        block_table=block_table.to(device),
        slot_mapping=torch.zeros(t_real + pad_tokens, dtype=torch.int64, device=device),
        num_tokens=t_real + pad_tokens, num_reqs=s,
        max_q_len=max(q_lens), max_kv_len=max(kv_lens),
        cu_seqlens_q_cpu=cu, kv_lens_cpu=kv,
    )
    return q.to(device), k_cache.to(device), v_cache.to(device), meta
