"""The graph-safe Triton attention backend: paged varlen attention plus the KV write.

Every length is read from device memory; the launch grid and the kernel variant depend only
on the padded token count, the slot count, head counts and the host-known bounds in the
metadata, so a CUDA graph captures ``forward`` and replays it for any batch that fits.
"""

from __future__ import annotations

import torch

from replaylm.attention.backend import AttentionBackend
from replaylm.batch import BLOCK_SIZE, AttentionMetadata
from replaylm.kernels import attention as attn_kernels
from replaylm.kernels import kv_write as kv_kernels


class TritonAttentionBackend(AttentionBackend):
    """Paged, varlen, causal GQA attention in Triton (head_dim a power of two, e.g. 64/128)."""

    name = "triton"
    graph_safe = True

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        kv_kernels.write_kv(k, v, k_cache, v_cache, slot_mapping)

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                rope: attn_kernels.RopeInputs | None = None) -> torch.Tensor:
        """Attention over the batch; with ``rope`` (decode steps only) ``q`` is the raw q
        projection and the launch also does the rotary kernel's work (``RopeInputs``)."""
        return attn_kernels.paged_attention(
            q, k_cache, v_cache, meta.cu_seqlens_q, meta.kv_lens, meta.block_table, scale,
            max_q_len=meta.max_q_len, max_kv_len=meta.max_kv_len, rope=rope,
        )

    def warmup(self, *, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
               device: torch.device, rope: bool = False, qk_norm: bool = False) -> None:
        """Run every kernel variant once on tiny inputs so nothing JITs during capture.

        The variants are: each decode/verify tile height (by ``max_q_len``), with and without
        split-KV (which also allocates the merge counters), the prefill tile, the KV write, and
        with ``rope`` decode with the rotary work inside (``qk_norm``: with Qwen3's q/k norm).
        """
        device = torch.device(device)
        g_pad = attn_kernels.group_pad(num_heads, num_kv_heads)
        k_cache = torch.zeros(3, BLOCK_SIZE, num_kv_heads, head_dim, device=device, dtype=dtype)
        v_cache = torch.zeros_like(k_cache)
        n = 2 * BLOCK_SIZE
        k = torch.randn(n, num_kv_heads, head_dim, device=device, dtype=dtype)
        self.write_kv(k, k, k_cache, v_cache, torch.arange(BLOCK_SIZE, 3 * BLOCK_SIZE,
                                                            device=device))
        block_table = torch.tensor([[1, 2]], device=device, dtype=torch.int32)
        kv_lens = torch.tensor([n], device=device, dtype=torch.int32)
        configs: dict[attn_kernels.AttnConfig, int] = {}
        for q_len in (1, 2, 4, 8, 16, 32, 64, 128, 4096):
            for few in (False, True):  # bandwidth- and latency-bound decode tiles
                configs.setdefault(attn_kernels.pick_config(q_len, g_pad, head_dim, few), q_len)
        for cfg, q_len in configs.items():
            t = min(q_len, n)
            q = torch.randn(t, num_heads, head_dim, device=device, dtype=dtype)
            cu = torch.tensor([0, t], device=device, dtype=torch.int32)
            for splits in (1, 2) if q_len <= 16 else (1,):
                attn_kernels.paged_attention(
                    q, k_cache, v_cache, cu, kv_lens, block_table, head_dim**-0.5,
                    max_q_len=q_len, max_kv_len=n, num_splits=splits, config=cfg,
                )
                if rope and q_len == 1:
                    norm = torch.ones(head_dim, device=device, dtype=dtype) if qk_norm else None
                    rope_inputs = attn_kernels.RopeInputs(
                        k=k[:1], v=k[:1], positions=kv_lens.long() - 1,
                        cos_sin=torch.zeros(n, head_dim, device=device),
                        slot_mapping=torch.tensor([BLOCK_SIZE], device=device),
                        q_norm_weight=norm, k_norm_weight=norm)
                    attn_kernels.paged_attention(
                        q, k_cache, v_cache, cu, kv_lens, block_table, head_dim**-0.5,
                        max_q_len=1, max_kv_len=n, num_splits=splits, config=cfg,
                        rope=rope_inputs,
                    )
        if device.type == "cuda":
            torch.cuda.synchronize(device)
