"""Requests with penalties draft too: each verify row is penalised as plain decoding
penalises its output position (the drafts before it count as outputs), and only emitted
rows become outputs."""

from __future__ import annotations

import pytest

from replaylm import SamplingParams
from replaylm.bench.spec_drafters import ControlledDrafter
from tests.speculative.test_spec_engine import NGRAM, _engine, _traffic

PENALTIES = [dict(repetition_penalty=1.3), dict(presence_penalty=0.6),
             dict(frequency_penalty=0.5),
             dict(repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.3)]


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    from tests.conftest import make_checkpoint

    path = tmp_path_factory.mktemp("spec-penalty-qwen3")
    make_checkpoint("qwen3", path, seed=11)
    return path


def _prompts():
    return [[30 + i, 31, 32, 33] * 5 for i in range(3)] + [[90, 7, 200, 13, 5, 71]]


@pytest.mark.parametrize("mode", ["eager", "ragged"])
def test_true_drafts_with_penalties_are_all_accepted(qwen3_dir, mode):
    # Drafts that are plain decoding's own output (greedy and seeded sampling): a verify
    # accepts every one only if each row's penalties see the drafts before it.
    prompts = _prompts()
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=20,
                             ignore_eos=True, **PENALTIES[i % len(PENALTIES)])
              for i in range(len(prompts))]
    plain = _engine(qwen3_dir, "eager", num_kv_blocks=40)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    llm = _engine(qwen3_dir, mode, NGRAM, num_kv_blocks=40)
    drafter = ControlledDrafter({tuple(p): list(w) for p, w in zip(prompts, want)}, 1.0,
                                llm.model_config.vocab_size, seed=0)
    llm.engine.use_drafter(drafter)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    st = llm.spec_stats()
    assert st["draft_tokens"] > 20 and st["accepted_tokens"] == st["draft_tokens"]
    assert not drafter.diverged


def test_wrong_drafts_with_penalties_leave_no_trace(qwen3_dir):
    # Rejected rows must not count as outputs: with half the drafts wrong, the penalised
    # output still equals plain decoding's.
    prompts = _prompts()
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                             **PENALTIES[i % len(PENALTIES)]) for i in range(len(prompts))]
    plain = _engine(qwen3_dir, "eager", num_kv_blocks=40)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    llm = _engine(qwen3_dir, "eager", NGRAM, num_kv_blocks=40)
    llm.engine.use_drafter(ControlledDrafter({tuple(p): list(w) for p, w in zip(prompts, want)},
                                             0.5, llm.model_config.vocab_size, seed=1))
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    st = llm.spec_stats()
    assert 0 < st["accepted_tokens"] < st["draft_tokens"]


def test_ngram_traffic_with_penalties_matches_plain(qwen3_dir):
    pen = dict(repetition_penalty=1.05, frequency_penalty=0.1)
    expected = _traffic(_engine(qwen3_dir, "eager"), seed=2, n_reqs=8, **pen)
    llm = _engine(qwen3_dir, "ragged", NGRAM)
    assert _traffic(llm, seed=2, n_reqs=8, **pen) == expected
    assert llm.spec_stats()["verify_steps"] > 0
