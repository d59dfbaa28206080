"""Graph nodes per tier, asserted: a change that adds (or removes) kernels in a replayed step
fails here until the table below is updated with it, so the count moves only on purpose.

Each replay costs about a microsecond per node on the device, and at batch 1 the nodes are
a measurable share of a step (docs/benchmarks.md, the floor). The tiny checkpoints take the
engine's paths (bf16, fused kernels) at every tier a ``full`` and a ``ragged`` engine
capture; a named shape may differ where the tuner picks a split-K tile (one more launch).
``piecewise`` graphs are the same kernels cut at attention.
"""

from __future__ import annotations

import pytest
import torch

from replaylm import LLM

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

MODES = ("full", "ragged")

#: ``(kind, mode) -> {tier: (nodes, tail nodes)}``, measured on an H100 (the tiny
#: checkpoints of ``tests/conftest.py``). A tier past ``skinny.MAX_M`` rows trades the skinny
#: kernels' fused prologues and epilogues for cuBLAS and separate launches; the MoE block
#: groups its assignments once they outnumber ``moe_decode.MAX_ASSIGNMENTS``.
EXPECTED: dict[tuple[str, str], dict[int, tuple[int, int | None]]] = {
    ("llama", "full"): {1: (14, 2), 2: (16, 2), 4: (16, 2), 8: (16, 2)},
    ("llama", "ragged"): {1: (14, 2), 2: (16, 2), 4: (16, 2), 8: (16, 2), 16: (22, 2),
                          24: (22, 2), 32: (22, 2), 40: (22, 2), 48: (22, 2)},
    ("qwen2_moe", "full"): {1: (31, 2), 2: (34, 2), 4: (34, 2), 8: (34, 2)},
    ("qwen2_moe", "ragged"): {1: (31, 2), 2: (34, 2), 4: (34, 2), 8: (34, 2), 16: (41, 2),
                              24: (45, 2), 32: (45, 2), 40: (45, 2), 48: (45, 2)},
    ("qwen3", "full"): {1: (19, 2), 2: (22, 2), 4: (22, 2), 8: (22, 2)},
    ("qwen3", "ragged"): {1: (19, 2), 2: (22, 2), 4: (22, 2), 8: (22, 2), 16: (31, 2),
                          24: (31, 2), 32: (31, 2), 40: (31, 2), 48: (31, 2)},
}


def captured_nodes(path, mode: str) -> dict[int, tuple[int, int | None]]:
    """``{tier: (nodes, tail nodes)}`` of every graph a bf16 engine on ``path`` captures in
    ``mode`` (the tail: the whole-model graph's sampling tail, None where there is none)."""
    llm = LLM(str(path), cuda_graph_mode=mode, dtype="bfloat16", num_kv_blocks=14,
              max_num_seqs=8, max_num_batched_tokens=48, max_model_len=192,
              max_graph_tokens=64, skip_tokenizer_init=True)
    stats = llm.graph_stats()
    return {int(key.split(":")[1]): (n, stats["tail_nodes"].get(key))
            for key, n in stats["nodes"].items() if key.startswith(f"{mode}:")}


@pytest.mark.parametrize("mode", MODES)
def test_graph_nodes_per_tier(graph_checkpoint, mode):
    kind, path, _ = graph_checkpoint
    got = captured_nodes(path, mode)
    assert got, f"{kind} {mode}: no graph captured"
    assert got == EXPECTED[kind, mode], (
        f"{kind} {mode}: graph nodes per tier changed; measured {sorted(got.items())}")
