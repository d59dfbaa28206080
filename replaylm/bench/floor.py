"""The floor ``bench decode`` sets beside every batch-1 figure: every weight one token reads,
read once at the H200's measured copy bandwidth, plus the replay cost of each graph node.
For an MoE model the weight bytes are those one token reads: its top-k experts, not all
(``bench startup`` reports the same bytes as the weights' size).
"""

from __future__ import annotations

from typing import Any

import torch

# Measured on the H200 (docs/benchmarks.md): device-to-device copy bandwidth and the replay
# cost of one graph node.
COPY_BANDWIDTH_BYTES_S = 4.23e12
GRAPH_NODE_S = 1e-6


def weight_bytes_of(llm: Any) -> int:
    """Weight bytes one token of the loaded model reads (all of them for a dense model);
    ``weight_bytes`` may be an int or a method of dtype."""
    wb = llm.model_config.weight_bytes
    if callable(wb):
        dtype = getattr(llm, "dtype", None)
        if not isinstance(dtype, torch.dtype):
            dtype = torch.bfloat16 if llm.device.type == "cuda" else torch.float32
        wb = wb(dtype, active=True)
    return int(wb)


def graph_nodes_of(llm: Any) -> int | None:
    """Nodes of the graph that served the most steps so far (piecewise: all its links)."""
    g = llm.graph_stats()
    if not g["hits"]:
        return None
    key = max(g["hits"], key=g["hits"].get)
    return g["nodes"].get(key)


def floor_ms(weight_bytes: int, graph_nodes: int | None) -> float:
    """Floor for one graphed batch-1 step: every weight read once, plus node replay cost."""
    seconds = weight_bytes / COPY_BANDWIDTH_BYTES_S + (graph_nodes or 0) * GRAPH_NODE_S
    return seconds * 1e3

