"""Reference attention in plain torch: correct for any batch, on CPU and GPU.

It loops over requests on the host (using the host copies of the lengths), so it is the
oracle for the Triton kernel and the CPU backend, not something a CUDA graph can capture.
"""

from __future__ import annotations

import torch

from replaylm.attention.backend import AttentionBackend
from replaylm.batch import BLOCK_SIZE, AttentionMetadata
from replaylm.kernels import ref


def gather_kv(cache: torch.Tensor, block_row: torch.Tensor, kv_len: int) -> torch.Tensor:
    """The first ``kv_len`` tokens of one request's paged cache, as ``[kv_len, Hkv, D]``."""
    nb = (kv_len + BLOCK_SIZE - 1) // BLOCK_SIZE
    return cache[block_row[:nb].long()].flatten(0, 1)[:kv_len]


def attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: list[int],
    kv_lens: list[int],
    block_table: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal paged attention computed in fp32, one request at a time."""
    out = torch.zeros_like(q)
    hq, hkv = q.shape[1], k_cache.shape[2]
    group = hq // hkv
    for i, kv_len in enumerate(kv_lens):
        s, e = cu_seqlens_q[i], cu_seqlens_q[i + 1]
        q_len = e - s
        if q_len == 0 or kv_len == 0:
            continue
        k = gather_kv(k_cache, block_table[i], kv_len).float().repeat_interleave(group, dim=1)
        v = gather_kv(v_cache, block_table[i], kv_len).float().repeat_interleave(group, dim=1)
        qi = q[s:e].float()
        scores = torch.einsum("qhd,khd->hqk", qi, k) * scale
        q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)
        k_pos = torch.arange(kv_len, device=q.device)
        scores.masked_fill_(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[s:e] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
    return out


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    graph_safe = False

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        ref.write_kv(k, v, k_cache, v_cache, slot_mapping)

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        assert meta.cu_seqlens_q_cpu is not None and meta.kv_lens_cpu is not None
        return attention_ref(
            q, k_cache, v_cache, meta.cu_seqlens_q_cpu, meta.kv_lens_cpu, meta.block_table, scale
        )
