"""Tensor parallelism as the model sees it: which shard this rank holds, and the collectives.

With ``tensor_parallel_size`` N each rank holds:

- its ``num_heads / N`` query heads and ``num_kv_heads / N`` KV heads (when there are fewer KV
  heads than ranks, N must be a multiple of them and each rank holds one KV head, shared with
  the ranks whose query heads read it): the fused qkv projection is column-parallel;
- ``intermediate_size / N`` of the MLP (gate | up column-parallel, down row-parallel);
- in MoE layers, ``moe_intermediate_size / N`` of every routed expert's FFN and
  ``shared_expert_intermediate_size / N`` of the shared expert's, split the same way; the
  router and the shared expert's sigmoid gate are replicated, so every rank routes every
  token to the same experts. Each rank adds its routed and gated shared partial sums and one
  all-reduce per MoE layer completes the block (``sigmoid(g) * shared`` is linear in the
  shared expert's partial sums);
- o_proj and down_proj row-parallel, summed by an all-reduce (their biases live on rank 0);
- ``ceil(vocab_size / N)`` rows of the embedding and of the LM head (the vocabulary padding
  rule: the last rank's rows past the vocabulary are zero); a lookup reads its own rows and
  zeroes the others, then an all-reduce; the logits slices are all-gathered, so every rank
  holds the full logits and samples the same tokens.

Every collective goes through :func:`all_reduce` and :func:`all_gather` below (torch.distributed:
gloo on CPU, NCCL on CUDA, inside captured graphs) or ``TensorParallel.all_reduce``, whose
``reducer`` may run a message on torch's symmetric memory instead (``model.allreduce``,
``EngineArgs.all_reduce_backend``); a model with no ``TensorParallel`` calls none of them.

Data-parallel attention (``EngineArgs.enable_dp_attention``, :class:`DataParallelAttention`)
splits only the dense MLP across the data-parallel ranks: each rank keeps every attention
head, its own KV pool, the whole embedding and LM head, and holds ``intermediate_size / M``
of gate | up and down. Per layer the ranks' normed hidden states, each padded to the token
count all ranks agreed on, are all-gathered (:func:`all_gather_into`), the MLP slice runs on
all of them, and :func:`reduce_scatter` sums the partial outputs and hands each rank its own
rows back.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from replaylm.model.allreduce import AllReducer
from replaylm.model.config import ModelConfig

# torch >= 2.13 names it all_gather_single; earlier releases all_gather_into_tensor.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = (getattr(dist, "reduce_scatter_single", None)
                          or dist.reduce_scatter_tensor)


def all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum ``x`` across the group's ranks, in place; returns ``x``."""
    dist.all_reduce(x, group=group)
    return x


def all_gather(x: torch.Tensor, size: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``[size, *x.shape]``: every rank's ``x``, in rank order."""
    out = torch.empty((size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(out, x.contiguous(), group=group)
    return out.view(size, *x.shape)


def all_gather_into(out: torch.Tensor, x: torch.Tensor, group: dist.ProcessGroup | None
                    ) -> torch.Tensor:
    """Every rank's ``x`` laid end to end along dim 0 in rank order, into ``out``
    (``[size * x.shape[0], *x.shape[1:]]``); returns ``out``."""
    _all_gather_single(out, x.contiguous(), group=group)
    return out


def reduce_scatter(x: torch.Tensor, size: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``x`` (``[size * rows, ...]``) summed across the group's ranks; returns this rank's
    block of ``rows`` rows (rank ``r`` gets rows ``r·rows .. (r+1)·rows - 1``)."""
    out = torch.empty((x.shape[0] // size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    _reduce_scatter_single(out, x.contiguous(), group=group)
    return out


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in its tensor-parallel group, and the group's collectives."""

    rank: int
    size: int
    group: dist.ProcessGroup | None = None
    num_kv_heads: int = 0  # the model's KV heads (all ranks), for the replicated layout
    # How all_reduce sums: torch.distributed until the runner configures it (after loading).
    reducer: AllReducer = field(default_factory=AllReducer, compare=False, repr=False)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` across the group's ranks, in place (the reducer's plan); returns ``x``."""
        return self.reducer(x, self.group)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return all_gather(x, self.size, self.group)

    def min_int(self, value: int) -> int:
        """The smallest ``value`` of any rank (a CPU collective)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Group rank 0's ``x`` on every rank, in place; returns ``x`` (outside graphs)."""
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        dist.broadcast(x, src, group=self.group)
        return x

    def vocab_rows(self, vocab_size: int) -> int:
        """Rows of the embedding / LM head each rank holds: ``ceil(vocab_size / size)``."""
        return -(-vocab_size // self.size)

    def kv_head_start(self) -> int:
        """The first of this rank's KV heads among the model's."""
        per_rank = max(1, self.num_kv_heads // self.size)
        if self.num_kv_heads >= self.size:
            return self.rank * per_rank
        return self.rank // (self.size // self.num_kv_heads)


def check_tensor_parallel(cfg: ModelConfig, size: int) -> None:
    """Raise ``ValueError`` naming ``tensor_parallel_size`` if ``cfg`` cannot be split ``size``
    ways."""
    if size == 1:
        return
    field = f"EngineArgs.tensor_parallel_size={size}"
    if cfg.num_heads % size:
        raise ValueError(f"{field} does not divide the model's {cfg.num_heads} attention heads")
    kv = cfg.num_kv_heads
    if kv >= size and kv % size:
        raise ValueError(f"{field} does not divide the model's {kv} KV heads")
    if kv < size and size % kv:
        raise ValueError(f"{field} is not a multiple of the model's {kv} KV heads (with fewer "
                         "KV heads than ranks, each KV head is replicated on size / KV heads "
                         "ranks)")
    sizes = {"moe_intermediate_size": cfg.moe_intermediate_size,
             "shared_expert_intermediate_size": cfg.shared_expert_intermediate_size}
    if _has_dense_mlp(cfg):
        sizes = {"intermediate_size": cfg.intermediate_size} | sizes
    for name, width in sizes.items():
        if width % size:
            raise ValueError(f"{field} does not divide the model's {name} {width}")


def _has_dense_mlp(cfg: ModelConfig) -> bool:
    """Whether any layer has a dense MLP (an MoE model whose layers are all sparse never
    uses ``intermediate_size``)."""
    return not all(cfg.is_moe_layer(i) for i in range(cfg.num_layers))


def shard_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The shapes one rank of ``size`` holds (``vocab_size`` stays the model's: every rank
    sees the full logits)."""
    check_tensor_parallel(cfg, size)
    if size == 1:
        return cfg
    return dataclasses.replace(
        cfg, num_heads=cfg.num_heads // size, num_kv_heads=max(1, cfg.num_kv_heads // size),
        intermediate_size=cfg.intermediate_size // size,  # unused without dense layers
        moe_intermediate_size=cfg.moe_intermediate_size // size,
        shared_expert_intermediate_size=cfg.shared_expert_intermediate_size // size)


@dataclass(frozen=True)
class DataParallelAttention:
    """This rank's place among the data-parallel ranks whose dense MLP is tensor-parallel
    (``EngineArgs.enable_dp_attention``), and the MLP's two collectives. Every rank calls
    them with the same row count each step: the token count the ranks agreed on."""

    rank: int
    size: int
    group: dist.ProcessGroup | None = None

    def gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``[size * T, ...]``: every rank's ``T`` rows of ``x``, in rank order."""
        out = torch.empty((self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype,
                          device=x.device)
        return all_gather_into(out, x, self.group)

    def scatter_sum(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, ...]``: this rank's rows of ``x`` (``[size * T, ...]``) summed over ranks."""
        return reduce_scatter(x, self.size, self.group)


def check_dp_attention(cfg: ModelConfig, size: int) -> None:
    """Raise ``ValueError`` naming ``enable_dp_attention`` if ``cfg``'s MLP cannot be split
    across ``size`` data-parallel ranks."""
    field = f"EngineArgs.enable_dp_attention=True with data_parallel_size={size}"
    if cfg.num_experts:
        raise ValueError(f"{field} is not supported for MoE models ({cfg.architecture}): "
                         "their MLP is routed experts; run them without enable_dp_attention")
    if cfg.intermediate_size % size:
        raise ValueError(f"{field}: {size} ranks do not divide the model's intermediate_size "
                         f"{cfg.intermediate_size}")


def dp_attention_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The shapes one data-parallel-attention rank holds: every head and the whole
    vocabulary, ``intermediate_size / size`` of the MLP."""
    check_dp_attention(cfg, size)
    return dataclasses.replace(cfg, intermediate_size=cfg.intermediate_size // size)
