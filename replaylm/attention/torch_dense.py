"""Graph-safe attention in plain torch: every length read on the device, shapes from bounds.

Each packed token finds its request with ``searchsorted`` over ``cu_seqlens_q`` and attends
over a ``max_kv_len``-wide window gathered through the block table, masked by its causal
position. Memory grows with ``T × max_kv_len``, so it serves CPU graph tests and small
batches; on the GPU the Triton backend does this job.
"""

from __future__ import annotations

import torch

from replaylm.attention.backend import AttentionBackend
from replaylm.batch import BLOCK_SIZE, AttentionMetadata
from replaylm.kernels import ref


def dense_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_kv_len: int,
    scale: float,
) -> torch.Tensor:
    t, hq, d = q.shape
    hkv = k_cache.shape[2]
    num_reqs = kv_lens.shape[0]
    dev = q.device
    tok = torch.arange(t, device=dev)
    # Request of each token: the number of request ends at or before it. Tokens past the last
    # real one (padding) get num_reqs, i.e. no request.
    req = torch.searchsorted(cu_seqlens_q[1:].contiguous(), tok, right=True)
    valid = req < num_reqs
    req_c = req.clamp(max=num_reqs - 1)
    kv_len = torch.where(valid, kv_lens[req_c], 0).long()
    q_end = cu_seqlens_q[1:][req_c].long()
    pos = kv_len - (q_end - tok)  # absolute position of each query token
    width = -(-max_kv_len // BLOCK_SIZE) * BLOCK_SIZE
    j = torch.arange(width, device=dev)
    blocks = block_table[req_c][:, j // BLOCK_SIZE].long()  # [T, width]
    slots = blocks * BLOCK_SIZE + j % BLOCK_SIZE
    allowed = (j[None, :] <= pos[:, None]) & (j[None, :] < kv_len[:, None]) & valid[:, None]
    k = k_cache.view(-1, hkv, d)[slots].float()  # [T, width, Hkv, D]
    v = v_cache.view(-1, hkv, d)[slots].float()
    # Zero what is masked: 0 × NaN would leak a poisoned scratch slot into real rows.
    k = torch.where(allowed[..., None, None], k, 0.0)
    v = torch.where(allowed[..., None, None], v, 0.0)
    qf = q.float().view(t, hkv, hq // hkv, d)
    scores = torch.einsum("tkgd,tjkd->tkgj", qf, k) * scale
    scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
    # Rows with nothing to attend to (padding) give 0, not NaN; real NaNs stay visible.
    probs = torch.where(allowed.any(-1)[:, None, None, None], torch.softmax(scores, dim=-1), 0.0)
    out = torch.einsum("tkgj,tjkd->tkgd", probs, v)
    return out.reshape(t, hq, d).to(q.dtype)


class TorchDenseAttentionBackend(AttentionBackend):
    """Graph-safe torch backend (no host sync; launch shapes from padded sizes and bounds)."""

    name = "torch_dense"
    graph_safe = True

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        ref.write_kv(k, v, k_cache, v_cache, slot_mapping)

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return dense_paged_attention(q, k_cache, v_cache, meta.cu_seqlens_q, meta.kv_lens,
                                     meta.block_table, meta.max_kv_len, scale)
