"""Speculative decoding with tensor parallel on two GPUs: the verify replays NCCL graphs, the
draft model runs unsharded on rank 0's GPU, and rank 0's rejection sampling reaches rank 1
through an NCCL broadcast.

fp32 keeps TP=2's row-parallel sums close enough to TP=1's that tokens agree; a near tie may
still part one request, so most (not all) requests must match. A rank whose kept tokens or
penalty counts differed from rank 0's would corrupt the shared activations of every request.
"""

from __future__ import annotations

import pytest
import torch

from replaylm import LLM, SamplingParams
from tests.conftest import make_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

SPANS = [[5 + (13 * i + 7 * j) % 200 for j in range(3 + i % 3)] for i in range(6)]
PROMPTS = [(s * 5)[: 4 + 3 * len(s)] for s in SPANS]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
SEEDED = [SamplingParams(max_tokens=24, temperature=0.8, top_k=40, seed=i, presence_penalty=0.5,
                         ignore_eos=True) for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp-spec-gpu")
    make_checkpoint("qwen3", path, seed=11)
    return path


def _run(path, tp: int, spec: dict | None) -> tuple[list, list, dict | None]:
    kw = dict(num_kv_blocks=64, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64,
              max_graph_tokens=64, skip_tokenizer_init=True, cuda_graph_mode="ragged",
              dtype="float32", distributed_timeout_s=300, speculative_config=spec)
    with LLM(str(path), tensor_parallel_size=tp, **kw) as llm:
        greedy = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        seeded = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SEEDED, use_tqdm=False)]
        return greedy, seeded, llm.spec_stats()


def _matching(a: list, b: list) -> int:
    return sum(x == y for x, y in zip(a, b))


def test_tp2_draft_model_follows_tp1(qwen3):
    spec = {"method": "draft_model", "model": str(qwen3), "num_speculative_tokens": 3}
    plain, _, _ = _run(qwen3, 1, None)
    _, want_seeded, _ = _run(qwen3, 1, spec)
    greedy, seeded, st = _run(qwen3, 2, spec)
    assert st["accepted_tokens"] > 0
    assert _matching(greedy, plain) >= len(PROMPTS) - 1, (greedy, plain)
    assert _matching(seeded, want_seeded) >= len(PROMPTS) - 1, (seeded, want_seeded)
