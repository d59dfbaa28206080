"""Data-parallel attention on two GPUs (NCCL all-gather and reduce-scatter inside the captured
graphs), bf16, against one GPU.

The MLP runs on both ranks' rows at once and its partial sums are reduced across the GPUs,
so bf16 rounds differently from one GPU: each request must follow DP=1's greedy tokens until
a step where DP=1's top two logprobs were within ``follow.TIE``, and most tokens must match overall.
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
LONE = [[7 + (13 * j) % 1000 for j in range(90)]]  # above the top tier: eager chunks
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("dpa-llama-gpu")
    make_checkpoint("llama", path, seed=13, vocab_size=1024, hidden_size=512,
                    intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                    num_key_value_heads=4)
    return path


def _outputs(path, dp: int):
    kw = dict(num_kv_blocks=128, max_model_len=256, skip_tokenizer_init=True, max_num_seqs=8,
              max_graph_tokens=64, cuda_graph_mode="ragged", dtype="bfloat16",
              distributed_timeout_s=300)
    if dp > 1:
        kw |= dict(data_parallel_size=dp, enable_dp_attention=True)
    with LLM(str(path), **kw) as llm:
        outs = [o.outputs[0] for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
        lone = [o.outputs[0] for o in llm.generate(LONE, PARAMS, use_tqdm=False)]
        graphs = llm.graph_stats()
    return outs + lone, graphs


def test_dp_attention2_follows_one_gpu_in_bf16_with_graphs(llama):
    want, _ = _outputs(llama, 1)
    got, graphs = _outputs(llama, 2)
    assert sum(graphs["hits"].values()) > 0  # decode steps replayed graphs on both ranks
    # The lone request's steps: the other rank replayed each graph and ran each eager chunk
    # on padding.
    dummies = [r["dummy_steps"] for r in graphs["ranks"]]
    assert any(d.get("eager", 0) > 0 for d in dummies)
    assert any(sum(v for k, v in d.items() if k != "eager") > 0 for d in dummies)
    assert_follows(want, got)
