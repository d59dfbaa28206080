"""One captured graph, whatever the mode: capture, replay, node count, and the bit-for-bit
check of a replay against the eager run of the same padded batch."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from replaylm.capture import gc_paused
from replaylm.graphs.stand_in import StandInGraph

log = logging.getLogger(__name__)


class GraphCheckError(AssertionError):
    """A replay differs from the eager run of the same padded batch."""


class Graph:
    """A CUDA graph, or on the CPU the stand-in that checks the same invariants (static
    buffers keep their addresses; nothing syncs the host)."""

    def __init__(self, name: str, device: torch.device, pool, static_getters) -> None:
        self.name, self.device, self.pool, self.static = name, device, pool, static_getters
        self.cuda = device.type == "cuda"
        self.graph = _cuda_graph() if self.cuda else StandInGraph(name)
        self.outputs: list[torch.Tensor] = []
        # The captured function: a tool may capture it again (``benchmarks/graph_update.py``).
        self.fn: Callable[[], Sequence[torch.Tensor]] | None = None

    def capture(self, fn: Callable[[], Sequence[torch.Tensor]]) -> list[torch.Tensor]:
        self.fn = fn
        if not self.cuda:
            self.outputs = self.graph.capture(fn, self.static)
            return self.outputs
        for _ in range(2):  # warm-up: JIT, autotune and library handles before capture
            fn()
        torch.cuda.synchronize(self.device)
        with gc_paused(), torch.cuda.graph(self.graph, pool=self.pool):
            self.outputs = list(fn())
        if hasattr(self.graph, "instantiate"):
            self.graph.instantiate()  # a kept graph is instantiated on demand: do it now
        return self.outputs

    def replay(self) -> None:
        self.graph.replay()

    def num_nodes(self) -> int | None:
        """Nodes (kernels and copies) in the graph; ``None`` where they cannot be counted."""
        if not self.cuda:
            return self.graph.num_nodes
        try:
            from cuda.bindings import runtime as cudart

            raw = self.graph.raw_cuda_graph()
            handle = cudart.cudaGraph_t(init_value=raw) if isinstance(raw, int) else raw
            err, _, count = cudart.cudaGraphGetNodes(handle, 0)
            return int(count) if int(err) == 0 else None
        except Exception as e:  # cuda-python missing, or a torch without raw_cuda_graph()
            log.debug("graph node count unavailable: %s", e)
            return None


def check_bits(graph_out: Sequence[torch.Tensor], eager_out: Sequence[torch.Tensor],
               where: str) -> None:
    """Raise ``GraphCheckError`` naming ``where`` unless every output is bit-identical
    (so NaN rows of poisoned padding compare equal to themselves)."""
    for i, (g, e) in enumerate(zip(graph_out, eager_out)):
        if not torch.equal(_bits(g), _bits(e)):
            diff = (g.float() - e.float()).abs().nan_to_num(float("inf")).max()
            raise GraphCheckError(
                f"graph check failed: {where} (output {i}), max abs diff {diff:.3g}")


def _cuda_graph() -> torch.cuda.CUDAGraph:
    # keep_graph: the cudaGraph_t stays readable after instantiation, to count its nodes.
    try:
        return torch.cuda.CUDAGraph(keep_graph=True)
    except TypeError:  # older torch: no keep_graph, so no node counts
        return torch.cuda.CUDAGraph()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)
