"""Speculative decoding under tensor parallel on CPU: two worker processes over gloo.

The leader drafts and packs each verify; both ranks run it (same dispatch, graphs and
collectives) and sample it the same way. With a draft model the leader alone holds the
proposals' distributions, so it broadcasts the tokens its rejection sampling kept.
"""

from __future__ import annotations

import pytest

from replaylm import LLM, SamplingParams
from tests.distributed.test_tensor_parallel import _checkpoint, _kw

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
# Prompts that repeat a span: prompt lookup finds drafts, and a model drafting for itself
# meets the same contexts again.
SPANS = [[5 + (13 * i + 7 * j) % 200 for j in range(3 + i % 3)] for i in range(6)]
PROMPTS = [(s * 5)[: 4 + 3 * len(s)] for s in SPANS]


def _seeded(n: int) -> list[SamplingParams]:
    """Seeded random sampling with strong penalties (verify rows count the drafts before
    them; a rank whose output counts differ samples other tokens)."""
    return [SamplingParams(max_tokens=16, temperature=1.0, top_k=5, seed=i,
                           presence_penalty=2.0, frequency_penalty=1.0, ignore_eos=True)
            for i in range(n)]


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


def _tokens(llm: LLM, params=GREEDY, prompts=PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _kw_spec(mode: str) -> dict:
    """Two graph tiers: every capture costs start-up time on each rank."""
    return _kw(mode) | (dict(graph_tiers="8,16") if mode != "eager" else {})


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return _checkpoint(tmp_path_factory, "qwen3")


@pytest.fixture(scope="module")
def near(tmp_path_factory, target):
    """The target with its weights perturbed: a draft model that agrees with it often."""
    from tests.conftest import perturbed_checkpoint

    path = tmp_path_factory.mktemp("tp-spec-near")
    perturbed_checkpoint(target, path)
    return path


@pytest.fixture(scope="module")
def plain(target) -> list[list[int]]:
    """Greedy tokens of plain decoding on one rank (on CPU every mode gives the same)."""
    return _tokens(LLM(str(target), **_kw("eager")))


@pytest.fixture(scope="module")
def ngram_seeded(target) -> list[list[int]]:
    """Seeded sampling through n-gram speculation on one rank (every verify layout emits
    the same tokens)."""
    return _tokens(LLM(str(target), speculative_config=NGRAM, **_kw("eager")),
                   _seeded(len(PROMPTS)))


@pytest.mark.parametrize("mode,verify,pipeline", [
    ("ragged", "ragged", "auto"), ("ragged", "padded", "auto"), ("eager", "ragged", "auto"),
    ("ragged", "ragged", "on")])
def test_ngram_tp2_matches_tp1(target, plain, ngram_seeded, mode, verify, pipeline):
    """Greedy: the tokens of plain decoding on one rank, drafts accepted. Seeded sampling
    with penalties: the tokens of speculative decoding on one rank. Pipelined, the ranks
    run the cohorts' steps in the leader's launch order."""
    spec = NGRAM | {"verify": verify, "pipeline": pipeline}
    with LLM(str(target), tensor_parallel_size=2, speculative_config=spec,
             **_kw_spec(mode)) as llm:
        assert _tokens(llm) == plain
        st = llm.spec_stats()
        assert st["verify_steps"] > 0 and st["accepted_tokens"] > 0
        assert (st["layout_pad_tokens"] > 0) == (verify == "padded")
        assert _tokens(llm, _seeded(len(PROMPTS))) == ngram_seeded
        assert (llm.spec_stats()["pipelined_steps"] > 0) == (pipeline == "on")
        graphs = llm.graph_stats()
    if mode != "eager":  # verifies replayed, checked bit for bit, padding poisoned
        assert graphs["checks"] > 0 and sum(graphs["hits"].values()) > 0


def test_draft_model_tp2_greedy_matches_plain_tp1(target, near, plain):
    """The draft model runs unsharded on the leader; greedy verifies accept by exact match
    on every rank: plain decoding's tokens, drafts accepted."""
    spec = {"method": "draft_model", "model": str(near), "num_speculative_tokens": 3}
    with LLM(str(target), tensor_parallel_size=2, speculative_config=spec,
             **_kw_spec("ragged")) as llm:
        assert _tokens(llm) == plain
        st = llm.spec_stats()
        graphs = llm.graph_stats()
    assert st["verify_steps"] > 0 and st["accepted_tokens"] > 0
    assert st["draft_forwards_per_step"] > 0
    assert graphs["checks"] > 0


def test_draft_model_tp2_rejection_sampling_matches_tp1(target, near):
    """Seeded sampling with penalties goes through rejection sampling on the leader, which
    broadcasts the kept tokens. Drafts stop below a confidence (0.25: about the median top
    probability of these requests' draft distributions), so some steps decode without drafts
    and feed the next step from each rank's ``last_token``: a follower whose kept tokens or
    penalty counts differed from the leader's would corrupt the shared activations."""
    spec = {"method": "draft_model", "model": str(near), "num_speculative_tokens": 3,
            "draft_confidence": 0.25}
    single = LLM(str(target), speculative_config=spec, **_kw("eager"))
    want = _tokens(single, _seeded(len(PROMPTS)))
    with LLM(str(target), tensor_parallel_size=2, speculative_config=spec,
             **_kw_spec("ragged")) as llm:
        assert _tokens(llm, _seeded(len(PROMPTS))) == want
        st = llm.spec_stats()
    assert st["rejections"] > 0 and st["accepted_tokens"] > 0  # the rule replaced some rows


def test_ngram_tp2_by_dp2_matches_plain_tp1(target, plain):
    """Two data-parallel ranks, each a tensor-parallel group of two: each leader drafts and
    verifies its own requests, the groups meet in the tier agreement, and the driver sums
    the leaders' counters."""
    with LLM(str(target), tensor_parallel_size=2, data_parallel_size=2, speculative_config=NGRAM,
             **_kw_spec("ragged")) as llm:
        assert len(llm.engine.procs) == 4
        assert _tokens(llm) == plain
        st = llm.spec_stats()
        ranks = llm.graph_stats()["ranks"]
    assert st["verify_steps"] > 0 and st["accepted_tokens"] > 0
    assert ranks[0]["agreement_steps"] == ranks[1]["agreement_steps"] > 0
