"""Sampling settings are bounded by the tensors they land in; extreme accepted values run.

A value that fits Python but not its per-slot device tensor (float32 / int64) must be refused
by ``SamplingParams`` naming the field, never fail later inside a step. Values at the edges
that are accepted must run. ``min_tokens`` masks EOS and ``stop_token_ids`` only, as
transformers' ``MinNewTokensLengthLogitsProcessor`` does.
"""

from __future__ import annotations

import math

import pytest
import torch

from replaylm import LLM, SamplingParams
from replaylm.sampling.penalties import LogitsProcessorState
from replaylm.sampling_params import FLOAT32_MAX, FLOAT32_TINY, GREEDY_BELOW, MAX_TOKEN_LIST

BIG = 2**63


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(min_tokens=BIG, max_tokens=None), "min_tokens"),
        (dict(min_tokens=10**30, max_tokens=None), "min_tokens"),
        (dict(max_tokens=BIG), "max_tokens"),
        (dict(temperature=3.5e38), "temperature"),
        (dict(temperature=math.inf), "temperature"),
        (dict(temperature=math.nan), "temperature"),
        (dict(temperature=10**40), "temperature"),
        (dict(repetition_penalty=3.5e38), "repetition_penalty"),
        (dict(repetition_penalty=1e-40), "repetition_penalty"),
        (dict(repetition_penalty=math.nan), "repetition_penalty"),
        (dict(top_p=math.nan), "top_p"),
        (dict(min_p=math.nan), "min_p"),
        (dict(presence_penalty=math.inf), "presence_penalty"),
        (dict(frequency_penalty=10**400), "frequency_penalty"),
        (dict(seed=BIG), "seed"),
        (dict(seed=1.5), "seed"),
        (dict(top_k=1.5), "top_k"),
        (dict(top_k=-2), "top_k"),
        (dict(n=True), "n"),
        (dict(min_tokens=True), "min_tokens"),
        (dict(stop_token_ids=[BIG]), "stop_token_ids"),
        (dict(stop_token_ids=[True]), "stop_token_ids"),
        (dict(stop_token_ids=list(range(MAX_TOKEN_LIST + 1))), "stop_token_ids"),
        (dict(logit_bias={"\u00b2": 1.0}), "logit_bias"),  # "²".isdigit() is True
        (dict(logit_bias={"\u0663": 1.0}), "logit_bias"),  # Arabic-Indic 3: int() takes it
        (dict(logit_bias={" 7": 1.0}), "logit_bias"),
        (dict(logit_bias={"-1": 1.0}), "logit_bias"),
        (dict(logit_bias={BIG: 1.0}), "logit_bias"),
        (dict(logit_bias={5: math.nan}), "logit_bias"),
        (dict(logit_bias={5: True}), "logit_bias"),
        (dict(logit_bias={i: 1.0 for i in range(MAX_TOKEN_LIST + 1)}), "logit_bias"),
        (dict(logprobs=BIG), "logprobs"),
    ],
)
def test_out_of_range_values_name_the_field(kwargs, field) -> None:
    with pytest.raises(ValueError, match=rf"^SamplingParams\.{field}=.* is invalid"):
        SamplingParams(**kwargs)


def test_greedy_below_threshold_and_top_k_above_vocab_is_off() -> None:
    assert SamplingParams(temperature=1e-40).greedy
    assert SamplingParams(temperature=GREEDY_BELOW / 2).greedy
    assert not SamplingParams(temperature=GREEDY_BELOW).greedy
    assert SamplingParams(top_k=BIG - 1).top_k == BIG - 1  # accepted: means no limit
    assert SamplingParams(logit_bias={"17": 2}).logit_bias == {17: 2.0}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from tests.conftest import make_checkpoint

    path = tmp_path_factory.mktemp("bounds-qwen2")
    make_checkpoint("qwen2", path, seed=3)
    return LLM(str(path), num_kv_blocks=64, max_model_len=64, max_num_seqs=8,
               skip_tokenizer_init=True)


PROMPT = [5, 17, 33, 80, 9]


def _tokens(llm, **kw) -> list[int]:
    sp = SamplingParams(max_tokens=kw.pop("max_tokens", 6), **kw)
    out = llm.generate([PROMPT], sp, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason in ("stop", "length"), out
    return out.token_ids


def test_extreme_accepted_values_run_in_one_batch(llm) -> None:
    """Every edge value at once, in one batch: the step neither raises nor loses a request."""
    extremes = [
        dict(top_k=BIG - 1, temperature=1.0, seed=BIG - 1),
        dict(min_tokens=BIG - 1, max_tokens=None, ignore_eos=True),
        dict(temperature=FLOAT32_MAX, seed=1),
        dict(repetition_penalty=FLOAT32_MAX, temperature=0.7, seed=2),
        dict(repetition_penalty=FLOAT32_TINY, temperature=0.7, seed=3, top_p=0.5),
        dict(temperature=1e-40),
        dict(stop_token_ids=[BIG - 1], logit_bias={255: 100.0, 0: -100.0}, min_tokens=2),
        dict(min_p=1.0, temperature=FLOAT32_MAX, top_k=3, seed=4),
    ]
    params = [SamplingParams(**{"max_tokens": 6, **kw}) for kw in extremes]
    outs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    for kw, out in zip(extremes, outs):
        comp = out.outputs[0]
        assert comp.finish_reason in ("stop", "length"), (kw, comp)
        assert all(0 <= t < 256 for t in comp.token_ids), kw
    assert llm.engine.block_manager.num_used_blocks == 0


def test_subnormal_temperature_is_greedy(llm) -> None:
    greedy = _tokens(llm, temperature=0.0, ignore_eos=True)
    assert _tokens(llm, temperature=1e-40, ignore_eos=True, seed=9) == greedy
    assert _tokens(llm, temperature=GREEDY_BELOW / 10, ignore_eos=True, seed=9) == greedy


def test_top_k_at_or_above_vocab_is_no_limit(llm) -> None:
    free = _tokens(llm, temperature=1.0, seed=11, ignore_eos=True, max_tokens=12)
    for k in (256, 10**6, BIG - 1):
        assert _tokens(llm, temperature=1.0, seed=11, ignore_eos=True, max_tokens=12,
                       top_k=k) == free


# --- min_tokens masks EOS and stop ids only (issue: token 0 was masked by the padding) -------

V = 40


def _hf_min_new_tokens(logits, prompt_len, generated, min_new, eos):
    from transformers.generation.logits_process import MinNewTokensLengthLogitsProcessor

    proc = MinNewTokensLengthLogitsProcessor(prompt_len, min_new, list(eos))
    ids = torch.zeros(1, prompt_len + generated, dtype=torch.long)
    return proc(ids, logits[None].clone())[0]


@pytest.mark.parametrize("generated", [0, 2, 3, 5])
def test_min_tokens_matches_transformers(generated) -> None:
    """Slots with fewer stop ids than the table's width (it widened for slot 0) and a slot
    with none at all (ignore_eos): only the listed ids are masked, never token 0."""
    state = LogitsProcessorState(4, V, "cpu")
    cases = [  # (params, eos passed to the slot)
        (SamplingParams(min_tokens=3, stop_token_ids=[7, 9, 11, 13, 15], max_tokens=8), (2,)),
        (SamplingParams(min_tokens=3, max_tokens=8), (2,)),
        (SamplingParams(min_tokens=3, max_tokens=8, ignore_eos=True), ()),
        (SamplingParams(min_tokens=3, stop_token_ids=[0], max_tokens=8), (2,)),
    ]
    for slot, (params, eos) in enumerate(cases):
        state.set(slot, params, [4, 5, 6], [], eos_token_ids=eos)
    state.flush()
    logits = torch.randn(len(cases), V, generator=torch.Generator().manual_seed(generated))
    slots = torch.arange(len(cases))
    out_pos = torch.full((len(cases),), generated)
    got = state.apply(logits, slots, out_pos, torch.ones(4), slots.tolist())
    for i, (params, eos) in enumerate(cases):
        masked = {*eos, *params.stop_token_ids}
        want = _hf_min_new_tokens(logits[i], 3, generated, params.min_tokens, sorted(masked))
        torch.testing.assert_close(got[i], want, msg=f"slot {i}")
        if 0 not in masked:
            assert got[i, 0] == logits[i, 0]


def test_min_tokens_does_not_mask_token_zero_end_to_end(llm) -> None:
    """Token 0 pushed to the top: it is generated during the min_tokens window too."""
    wide = SamplingParams(min_tokens=4, max_tokens=6, stop_token_ids=list(range(100, 140)),
                          temperature=0.0)
    zero = SamplingParams(min_tokens=4, max_tokens=6, ignore_eos=True, temperature=0.0,
                          logit_bias={0: 100.0})
    outs = llm.generate([PROMPT, PROMPT], [wide, zero], use_tqdm=False)
    assert outs[1].outputs[0].token_ids == [0] * 6
