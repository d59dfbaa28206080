"""LoRA under tensor parallelism (two worker processes over gloo) and data parallelism: each
rank holds its shard of every adapter (A whole and B by output rows for qkv and gate_up, A by
input columns and B whole for o_proj and down_proj), the leader's slot changes reach the
other rank before the steps that use them, and greedy output is PEFT's on one process."""

from __future__ import annotations

import pytest

from replaylm import LLM, LoRARequest
from tests.lora.helpers import GREEDY, PROMPTS
from tests.lora.test_lora_engine import tokens


def _kw(mode: str, **kw) -> dict:
    kw = dict(enable_lora=True, max_lora_rank=16, num_kv_blocks=40, max_num_seqs=8,
              max_num_batched_tokens=64, max_model_len=64, max_graph_tokens=16,
              skip_tokenizer_init=True, attention_backend="torch_dense",
              distributed_timeout_s=120.0) | kw
    if mode == "eager":
        return kw | dict(enforce_eager=True)
    return kw | dict(cuda_graph_mode=mode, graph_tiers="4,16", graph_check=1,
                     poison_padding=True)


def _mixed(loras, expected):
    choices = [None, *loras]
    prompts, reqs, want = [], [], []
    for i, p in enumerate(PROMPTS):
        for j in range(2):
            prompts.append(p)
            reqs.append(choices[(i + 2 * j) % len(choices)])
            want.append(expected[reqs[-1]][i])
    return prompts, reqs, want


@pytest.mark.parametrize("kind,mode", [("llama", "eager"), ("qwen2", "full_and_piecewise")])
def test_tensor_parallel_matches_peft(lora_setup, kind, mode):
    """llama: 2 KV heads split over 2 ranks; qwen2: 1 KV head replicated on both. Two slots
    for three adapters, so slots change (and the follower follows) mid-run."""
    base, loras, expected = lora_setup(kind)
    prompts, reqs, want = _mixed(loras, expected)
    with LLM(str(base), tensor_parallel_size=2, **_kw(mode, max_loras=2)) as llm:
        assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=reqs)) == want
        with pytest.raises(ValueError, match="needs adapter_config.json"):
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False,
                         lora_request=LoRARequest("missing", 9, "/no/such/dir"))
        # The ranks go on after the refusal.
        assert tokens(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False,
                                   lora_request=loras[0])) == [expected[loras[0]][0]]


def test_data_parallel_matches_peft(lora_setup):
    """Two data-parallel ranks, each with its own slots and residency."""
    base, loras, expected = lora_setup("llama")
    prompts, reqs, want = _mixed(loras, expected)
    with LLM(str(base), data_parallel_size=2, **_kw("eager", max_loras=2)) as llm:
        assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=reqs)) == want
