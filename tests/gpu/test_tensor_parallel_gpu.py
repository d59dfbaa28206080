"""Tensor parallel on two GPUs (NCCL, all-reduces inside the captured graphs), bf16.

bf16 row-parallel partial sums round differently from one GPU's full sums, so greedy tokens
may part at a near tie: each request must follow TP=1's tokens until a step where TP=1's
top two logprobs were within ``follow.TIE``, and most tokens must match overall.
"""

from __future__ import annotations

import pytest
import torch

from replaylm import LLM, SamplingParams
from tests.conftest import make_checkpoint
from tests.gpu.follow import assert_follows

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

PROMPTS = [[3 + (17 * i + 5 * j) % 1000 for j in range(4 + 9 * i)] for i in range(6)]
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp-llama-gpu")
    make_checkpoint("llama", path, seed=11, vocab_size=1024, hidden_size=512,
                    intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                    num_key_value_heads=4)
    return path


@pytest.fixture(scope="module", params=["qwen2_moe", "qwen3_moe"])
def moe(request, tmp_path_factory):
    """Tiny MoE checkpoints (vocabulary 256): Qwen2-MoE's experts of 32 and shared expert of
    80 split 16 and 40 a rank, Qwen3-MoE's experts of 48 split 24 a rank."""
    path = tmp_path_factory.mktemp(f"tp-{request.param}-gpu")
    make_checkpoint(request.param, path, seed=11)
    return request.param, path


def _outputs(path, mode: str, tp: int, prompts=PROMPTS, **extra):
    kw = dict(num_kv_blocks=128, max_model_len=256, skip_tokenizer_init=True, max_num_seqs=8,
              max_graph_tokens=64, cuda_graph_mode=mode, dtype="bfloat16",
              distributed_timeout_s=300) | extra
    with LLM(str(path), tensor_parallel_size=tp, **kw) as llm:
        outs = [o.outputs[0] for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
        graphs = llm.graph_stats()
    return outs, graphs


# ragged: every message up to 256 rows on symmetric memory (one-shot or two-shot, measured);
# full_and_piecewise: auto, whatever this machine measured fastest per size.
@pytest.mark.parametrize("mode,all_reduce", [("ragged", "symm_mem"),
                                             ("full_and_piecewise", "auto")])
def test_tp2_follows_tp1_greedy_tokens_in_bf16_with_graphs(llama, mode, all_reduce):
    want, _ = _outputs(llama, mode, 1)
    got, graphs = _outputs(llama, mode, 2, all_reduce_backend=all_reduce)
    assert sum(graphs["hits"].values()) > 0  # decode steps replayed graphs
    report = graphs["all_reduce"]
    assert report["setting"] == all_reduce and report["reason"].startswith("measured"), report
    assert len(report["latency_us"]) == 4 and report["choice"], report
    if all_reduce == "symm_mem":
        assert "nccl" not in report["choice"].values(), report
    assert_follows(want, got)


def test_moe_tp2_follows_tp1_in_bf16_with_graphs(moe):
    """Sharded experts on two GPUs: decode batches take the per-assignment GEMVs, prefill
    chunks the grouped kernels, at each rank's expert width; Qwen2-MoE's shared expert runs
    on the side stream inside the captures and the all-reduce follows the join."""
    kind, path = moe
    prompts = [[3 + (17 * i + 5 * j) % 250 for j in range(4 + 9 * i)] for i in range(6)]
    want, _ = _outputs(path, "ragged", 1, prompts)
    got, graphs = _outputs(path, "ragged", 2, prompts)
    assert sum(graphs["hits"].values()) > 0
    if kind == "qwen2_moe":
        assert any(graphs["forks"].values())  # the side stream forked in a capture
    assert_follows(want, got)
