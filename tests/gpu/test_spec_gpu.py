"""Speculative decoding on the H200: every verify layout through real CUDA graphs emits
plain decoding's greedy tokens (float32, so batch shape changes no argmax), and each
graph replay equals eager on the same padded batch."""

from __future__ import annotations

import pytest
import torch

from replaylm import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}


def _engine(path, spec=None, **kw) -> LLM:
    args = dict(num_kv_blocks=40, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=192,
                max_graph_tokens=64, skip_tokenizer_init=True, dtype="float32",
                cuda_graph_mode="ragged", speculative_config=spec)
    return LLM(str(path), **(args | kw))


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    spans = [torch.randint(3, 256, (int(n),), generator=g).tolist() for n in (2, 3, 4, 5)]
    return [(s * 10)[:24] for s in spans] + [torch.randint(3, 256, (17,), generator=g).tolist()]


@pytest.mark.parametrize("verify", ["ragged", "padded", "eager"])
def test_every_verify_layout_matches_plain_with_graphs(graph_checkpoint, verify):
    _, path, _ = graph_checkpoint
    sp = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
          SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                         repetition_penalty=1.1, frequency_penalty=0.2)]
    prompts = _prompts()
    params = [sp[i % 2] for i in range(len(prompts))]
    want = [o.outputs[0].token_ids for o in _engine(path).generate(prompts, params,
                                                                  use_tqdm=False)]
    llm = _engine(path, NGRAM | {"verify": verify}, graph_check=1)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    st, gs = llm.spec_stats(), llm.graph_stats()
    assert st["verify_steps"] > 0 and st["accepted_tokens"] > 0
    assert gs["checks"] > 0
    if verify == "padded":
        assert st["layout_pad_tokens"] > 0
    if verify == "eager":
        assert gs["fallbacks"].get("speculative_config verify=eager", 0) >= st["verify_steps"]
