"""Logit processing (penalties, logit_bias, min_p, min_tokens) against a plain reference."""

from __future__ import annotations

import math

import pytest
import torch

from replaylm import LLM, SamplingParams
from replaylm.sampling.penalties import LogitsProcessorState

V = 50


def reference(logits: torch.Tensor, params: SamplingParams, prompt: list[int],
              output: list[int], eos: tuple[int, ...]) -> torch.Tensor:
    """One row, written out token by token the way the semantics are stated."""
    x = [float(v) for v in logits]
    if len(output) < params.min_tokens:
        for t in {*eos, *params.stop_token_ids}:
            x[t] = -math.inf
    for t, b in (params.logit_bias or {}).items():
        x[t] += b
    for t in range(V):
        count = output.count(t)
        if t in prompt or count:
            r = params.repetition_penalty
            x[t] = x[t] / r if x[t] > 0 else x[t] * r
        x[t] -= params.frequency_penalty * count
        if count:
            x[t] -= params.presence_penalty
    if params.min_p > 0:
        # Keep tokens whose probability after temperature is >= min_p * the top probability.
        t_ = params.temperature
        probs = torch.tensor(x).div(t_ if t_ > 0 else 1.0).softmax(-1)
        keep = probs >= params.min_p * probs.max()
        if t_ == 0:
            keep = torch.tensor(x) == max(x)
        x = [v if k else -math.inf for v, k in zip(x, keep.tolist())]
    return torch.tensor(x)


CASES = [
    SamplingParams(temperature=0.0),
    SamplingParams(presence_penalty=0.7, frequency_penalty=0.3),
    SamplingParams(repetition_penalty=1.5, temperature=0.7),
    SamplingParams(repetition_penalty=0.6, presence_penalty=-0.5),
    SamplingParams(min_p=0.2, temperature=0.5),
    SamplingParams(min_p=0.05, temperature=0.0),
    SamplingParams(logit_bias={3: 5.0, 7: -100.0, 0: 1.5}),
    SamplingParams(min_tokens=4, stop_token_ids=[9, 11], max_tokens=10),
    SamplingParams(min_tokens=2, max_tokens=10, frequency_penalty=1.0, logit_bias={1: 2.0},
                   min_p=0.1, repetition_penalty=1.2),
]


def _setup(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    state = LogitsProcessorState(len(CASES) + 2, V, "cpu")
    rows = []
    for slot, params in enumerate(CASES):
        prompt = torch.randint(0, V, (int(torch.randint(1, 20, (1,), generator=g)),),
                               generator=g).tolist()
        output = torch.randint(0, V, (int(torch.randint(0, 8, (1,), generator=g)),),
                               generator=g).tolist()
        state.set(slot, params, prompt, output, eos_token_ids=(1,))
        rows.append((slot, params, prompt, output))
    state.flush()
    return g, state, rows


def test_apply_matches_reference() -> None:
    g, state, rows = _setup()
    logits = torch.randn(len(rows), V, generator=g) * 3
    slots = torch.tensor([r[0] for r in rows])
    out_pos = torch.tensor([len(r[3]) for r in rows])
    temperature = torch.zeros(state.max_num_seqs)
    for slot, params, *_ in rows:
        temperature[slot] = params.temperature
    got = state.apply(logits, slots, out_pos, temperature, slots.tolist())
    for i, (_, params, prompt, output) in enumerate(rows):
        want = reference(logits[i], params, prompt, output, eos=(1,))
        torch.testing.assert_close(got[i], want, msg=f"case {i}: {params}")
    # The input logits are left untouched (logprobs read them raw).
    assert not torch.equal(got, logits)


def test_record_counts_sampled_tokens_like_a_recount() -> None:
    g, state, rows = _setup(1)
    slots = torch.tensor([r[0] for r in rows])
    for _ in range(3):
        tokens = torch.randint(0, V, (len(rows),), generator=g)
        state.record(slots, tokens, slots.tolist())
        for (*_, output), t in zip(rows, tokens.tolist()):
            output.append(t)
    fresh = LogitsProcessorState(state.max_num_seqs, V, "cpu")
    for slot, params, prompt, output in rows:
        fresh.set(slot, params, prompt, output, eos_token_ids=(1,))
        if params.uses_penalties:
            assert torch.equal(state.output_counts[slot], fresh.output_counts[slot]), slot


def test_reused_slot_is_reset_and_plain_slots_are_inactive() -> None:
    _, state, rows = _setup(2)
    plain = SamplingParams()
    for slot, *_ in rows:
        state.set(slot, plain, [1, 2], [], eos_token_ids=(1,))
    state.flush()
    assert not state.active(list(range(len(rows))))
    logits = torch.randn(len(rows), V)
    slots = torch.arange(len(rows))
    got = state.apply(logits, slots, torch.zeros(len(rows), dtype=torch.int64),
                      torch.ones(state.max_num_seqs), slots.tolist())
    assert torch.equal(got, logits)  # neutral settings leave every logit bit-identical


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-3.0), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(min_p=1.5), "min_p"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=5, max_tokens=3), "min_tokens"),
        (dict(logit_bias={-1: 1.0}), "logit_bias"),
        (dict(logit_bias={3: 500.0}), "logit_bias"),
        (dict(logprobs=-1), "logprobs"),
        (dict(prompt_logprobs=-2), "prompt_logprobs"),
        (dict(stop=[""]), "stop"),
        (dict(n=0), "n"),
        (dict(n=2, best_of=3), "best_of"),
    ],
)
def test_invalid_params_name_the_field(kwargs, field) -> None:
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}=.*(must|invalid)"):
        SamplingParams(**kwargs)


def test_logit_bias_accepts_string_keys() -> None:
    assert SamplingParams(logit_bias={"7": 1}).logit_bias == {7: 1.0}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from tests.conftest import make_checkpoint

    path = tmp_path_factory.mktemp("penalty-llama")
    make_checkpoint("llama", path, seed=4)
    return LLM(str(path), num_kv_blocks=128, max_num_seqs=8, skip_tokenizer_init=True)


def test_engine_penalties_change_greedy_and_fast_path_is_untouched(llm, monkeypatch) -> None:
    prompt = [5, 6, 7, 8]
    base_sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    procs = llm.engine.runner.sampler.procs

    def boom(*a, **k):
        raise AssertionError("apply ran for a batch without logit processing")

    with monkeypatch.context() as m:
        m.setattr(procs, "apply", boom)
        base = llm.generate([prompt], base_sp, use_tqdm=False)[0].outputs[0].token_ids
    rep = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                frequency_penalty=2.0), use_tqdm=False)
    toks = rep[0].outputs[0].token_ids
    assert toks != base
    # A strong frequency penalty keeps the greedy output from repeating itself much.
    assert max(toks.count(t) for t in set(toks)) < max(base.count(t) for t in set(base)) or \
        len(set(toks)) > len(set(base))


def test_engine_min_tokens_masks_eos(llm) -> None:
    eos = llm.model_config.eos_token_ids[0]
    sp = SamplingParams(temperature=0.0, max_tokens=12, logit_bias={eos: 100.0}, min_tokens=5)
    out = llm.generate([[5, 6, 7]], sp, use_tqdm=False)[0].outputs[0]
    assert eos not in out.token_ids[:5]
    assert out.token_ids[5] == eos and len(out.token_ids) == 6
    assert out.finish_reason == "stop"
    forced = llm.generate([[9, 9]], SamplingParams(temperature=0.0, max_tokens=4,
                                                   logit_bias={17: 100.0}), use_tqdm=False)
    assert forced[0].outputs[0].token_ids == [17] * 4
