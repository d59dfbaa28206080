"""The attention-backend interface: paged, varlen, causal attention over the front-packed
batch (``replaylm.batch``: layout, padding rules and ``AttentionMetadata``)."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from replaylm.batch import AttentionMetadata


class AttentionBackend(ABC):
    """Paged, varlen, causal attention over the front-packed batch (GQA, head_dim 64/128).

    Caches are per layer ``[num_blocks, BLOCK_SIZE, num_kv_heads, head_dim]``; the token at
    slot ``s`` lives at ``cache[s // BLOCK_SIZE, s % BLOCK_SIZE]``. Block 0 is scratch.
    """

    name: str = "base"
    #: True when ``forward`` reads every length from device memory and never syncs the host,
    #: so a CUDA graph may capture it.
    graph_safe: bool = False

    @abstractmethod
    def write_kv(
        self,
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [T] int64
    ) -> None:
        """Store the new tokens' K/V at their slots (padded tokens write block 0)."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Return ``[T, Hq, D]``; rows of padded tokens are unspecified (they are dropped)."""

    def warmup(self, *, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
               device: torch.device, rope: bool = False, qk_norm: bool = False) -> None:
        """Compile every kernel variant a later capture may need (no JIT during capture).

        Backends without compiled kernels have nothing to do.
        """
        return None
