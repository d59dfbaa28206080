"""The ranks' process groups and the per-step graph-tier agreement over them."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


def init_group(rank: int, world_size: int, init_method: str, timeout_s: float,
               cuda: bool = False) -> None:
    """Join the ranks' process group: gloo for CPU tensors (the tier agreement, on any
    device) and, with ``cuda``, NCCL for CUDA tensors (the tensor-parallel collectives)."""
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", init_method=init_method,
                            rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))


def tensor_parallel_group(rank: int, data_parallel_size: int, tensor_parallel_size: int,
                          timeout_s: float) -> dist.ProcessGroup:
    """This rank's tensor-parallel group: ranks ``d·N .. d·N + N - 1`` form data-parallel
    rank ``d``'s group (every rank creates every group, in the same order)."""
    n = tensor_parallel_size
    mine = None
    for d in range(data_parallel_size):
        group = dist.new_group(list(range(d * n, (d + 1) * n)),
                               timeout=timedelta(seconds=timeout_s))
        if rank // n == d:
            mine = group
    return mine


class TierAgreement:
    """Called once per step by every rank (``GraphRuntime.dispatch``): one all-reduce of
    ``(num_tokens, num_reqs, -uniform_decode, -can_graph)`` with MAX gives the largest step
    of any rank and whether every rank's step is a uniform decode and may use a graph."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self._buf = torch.zeros(4, dtype=torch.int64)

    def __call__(self, num_tokens: int, num_reqs: int, uniform_decode: bool,
                 can_graph: bool) -> tuple[int, int, bool, bool]:
        buf = self._buf
        buf[0], buf[1] = num_tokens, num_reqs
        buf[2], buf[3] = -int(uniform_decode), -int(can_graph)
        dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=self.group)
        tokens, reqs, uniform, graph = buf.tolist()
        return tokens, reqs, uniform < 0, graph < 0
