"""Logprobs of sampled and prompt tokens equal log_softmax of transformers' logits."""

from __future__ import annotations

import pytest
import torch

from replaylm import LLM, SamplingParams
from replaylm.sampling.logprobs import device_logprobs


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tests.conftest import make_checkpoint

    path = tmp_path_factory.mktemp("logprobs-llama")
    model = make_checkpoint("llama", path, seed=11)
    return path, model


def _ref_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return logits.log_softmax(-1)


def _check(lp, ref_row: torch.Tensor, token: int, k: int) -> None:
    assert lp.token_id == token
    torch.testing.assert_close(lp.logprob, ref_row[token].item(), atol=2e-4, rtol=0)
    assert lp.rank == int((ref_row > ref_row[token]).sum()) + 1
    assert len(lp.top) == k
    want = ref_row.topk(k)
    torch.testing.assert_close(torch.tensor(list(lp.top.values())), want.values, atol=2e-4,
                               rtol=0)
    # Ids must agree except where two logprobs are (numerically) tied.
    for (tid, v), wid in zip(lp.top.items(), want.indices.tolist()):
        assert tid == wid or abs(ref_row[wid].item() - v) < 1e-4


@pytest.mark.parametrize("tiny_pool", [False, True])
def test_logprobs_match_transformers(ckpt, tiny_pool) -> None:
    path, model = ckpt
    kw = dict(num_kv_blocks=128, max_num_seqs=8)
    if tiny_pool:  # chunked prefill over 8-token chunks, and preemption
        kw = dict(num_kv_blocks=6, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=80)
    llm = LLM(str(path), skip_tokenizer_init=True, **kw)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 23, 40, 1)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3,
                       prompt_logprobs=2),
        SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True, logprobs=0,
                       repetition_penalty=1.3),
        SamplingParams(temperature=1.0, seed=5, max_tokens=9, ignore_eos=True, logprobs=5,
                       prompt_logprobs=0),
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=4),
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    if tiny_pool:
        assert llm.stats().preemptions > 0
    for prompt, sp, out in zip(prompts, params, outs):
        comp = out.outputs[0]
        ref = _ref_logprobs(model, prompt + comp.token_ids)
        if sp.logprobs is None:
            assert comp.logprobs is None
        else:
            assert len(comp.logprobs) == len(comp.token_ids)
            for j, (tok, lp) in enumerate(zip(comp.token_ids, comp.logprobs)):
                # Raw model logprobs: penalties and temperature do not enter.
                _check(lp, ref[len(prompt) + j - 1], tok, sp.logprobs)
        if sp.prompt_logprobs is None:
            assert out.prompt_logprobs is None
        else:
            assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
            for i in range(1, len(prompt)):
                _check(out.prompt_logprobs[i], ref[i - 1], prompt[i], sp.prompt_logprobs)


def test_device_logprobs_is_log_softmax() -> None:
    logits = torch.randn(4, 30)
    tokens = torch.tensor([0, 5, 29, 7])
    got = device_logprobs(logits, tokens, 3).rows([3, None, 0, 1])
    ref = logits.log_softmax(-1)
    assert got[1] is None and got[2].top == {}
    for i in (0, 2, 3):
        _check(got[i], ref[i], tokens[i].item(), [3, None, 0, 1][i])
