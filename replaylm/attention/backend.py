"""The attention-backend interface and the per-step metadata every backend reads.

The batch is front-packed (DESIGN.md): the new tokens of all requests laid end to end.
Request ``i`` owns packed query rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]``; its context after
this step is ``kv_lens[i]`` tokens, so its new tokens sit at absolute positions
``kv_lens[i] - q_len_i .. kv_lens[i] - 1`` and attend causally to everything before them.

Padding (a batch of T real tokens / B requests run at T_pad tokens / S slots):
``cu_seqlens_q[B..S] = T``, ``kv_lens[B..S] = 0``, ``block_table[B..S] = 0``; tokens
``T..T_pad`` belong to no request and write scratch block 0 through ``slot_mapping``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

BLOCK_SIZE = 16  # tokens per KV block; fixed across the project


@dataclass
class AttentionMetadata:
    """Device tensors of one step, built once per step; layers read it, nothing mutates it.

    ``num_tokens`` / ``num_reqs`` are the (possibly padded) sizes the tensors have;
    ``max_q_len`` / ``max_kv_len`` are host-known upper bounds (for a graph: of its tier),
    so no backend needs to read a length back from the device.
    """

    cu_seqlens_q: torch.Tensor  # [S+1] int32
    kv_lens: torch.Tensor  # [S] int32
    block_table: torch.Tensor  # [S, max_blocks] int32
    slot_mapping: torch.Tensor  # [T] int64
    num_tokens: int
    num_reqs: int
    max_q_len: int
    max_kv_len: int
    # Host copies for the torch reference backend (never read by graph-safe backends).
    cu_seqlens_q_cpu: list[int] | None = None
    kv_lens_cpu: list[int] | None = None


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
