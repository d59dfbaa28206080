"""The floor ``bench decode`` sets beside every batch-1 figure: every weight one token reads,
read once at the H200's measured copy bandwidth, plus the replay cost of each graph node.
For an MoE model the weight bytes are those one token reads: its top-k experts, not all
(``bench startup`` reports the same bytes as the weights' size). With FP8 weights
(``EngineArgs.quantization`` or an FP8 checkpoint) they are the bytes held: one per FP8
parameter, four per row for its scale, the model dtype for the rest (embedding row, norms,
a bf16 LM head).
"""

from __future__ import annotations

from typing import Any

import torch

from replaylm.engine.loading import load_model_config
from replaylm.model import quant
from replaylm.model.compressed_tensors import fp8_scheme

# Measured on the H200 (docs/benchmarks.md): device-to-device copy bandwidth and the replay
# cost of one graph node.
COPY_BANDWIDTH_BYTES_S = 4.23e12
GRAPH_NODE_S = 1e-6


def weight_bytes_of(llm: Any) -> int:
    """Weight bytes one token of the loaded model reads (all of them for a dense model);
    ``weight_bytes`` may be an int or a method of dtype."""
    cfg = llm.model_config
    wb = cfg.weight_bytes
    if callable(wb):
        dtype = getattr(llm, "dtype", None)
        if not isinstance(dtype, torch.dtype):
            dtype = torch.bfloat16 if llm.device.type == "cuda" else torch.float32
        scheme = _fp8_scheme_of(llm)
        wb = quant.weight_bytes(cfg, dtype, scheme, active=True) if scheme else wb(dtype, True)
    return int(wb)


def _fp8_scheme_of(llm: Any) -> quant.Fp8Scheme | None:
    """The FP8 scheme the engine of ``llm`` loaded its weights with (None: none)."""
    args = getattr(llm, "engine_args", None)
    if args is None:
        return None
    model_dir = load_model_config(args.model)[1]
    return fp8_scheme(llm.model_config, model_dir, args.quantization, args.quantize_lm_head)


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

