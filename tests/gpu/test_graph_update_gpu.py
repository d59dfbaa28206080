"""``cuGraphExecUpdate`` on captured graphs (``benchmarks/graph_update.py``): each graph of a
small engine is patched from a fresh capture of its own function, replays bit-identically to
that capture, is patched back, and the engine's outputs and audit are as before.

Run alone: ``pytest -m gpu tests/gpu/test_graph_update_gpu.py -s``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@pytest.mark.parametrize("mode", ["full_and_piecewise", "ragged"])
def test_exec_update_patches_and_restores_every_graph(mode):
    from benchmarks.graph_update import measure_graph, summarize
    from replaylm import LLM, SamplingParams

    llm = LLM("llama3.2-1b", load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              max_num_seqs=4, num_kv_blocks=128, max_model_len=256,
              max_num_batched_tokens=256, cuda_graph_mode=mode, graph_tiers="1,2,4,16",
              max_graph_tokens=16)
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [[1 + (5 * i + j) % 900 for j in range(9 + 4 * i)] for i in range(4)]
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    graphs = llm.engine.runner.graphs
    rows = [measure_graph(g, [graphs.last_token]) for g in graphs.captured()]
    s = summarize(mode, rows, 0.0)
    print(f"\n{mode}: {s}")
    assert rows and all(r["update_result"] == "success" for r in rows), rows
    assert s["updates_bit_identical"], [r["graph"] for r in rows
                                        if not r.get("update_bit_identical", True)]
    assert all(r["restore_result"] == "success" for r in rows), rows
    assert llm.audit_graphs().kernels > 0
    after = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert after == before
