"""The ``draft_model`` drafter through the engine: greedy output equals plain decoding token
for token, sampling keeps the target's distribution (chi-square), the draft KV pool never
leaks, and bad settings fail at start-up naming the field."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from replaylm import LLM, SamplingParams
from replaylm.engine.draft_runner import check_draft_model
from replaylm.engine.loading import load_model_config
from tests.speculative.test_spec_engine import _engine, _traffic


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    from tests.conftest import make_checkpoint

    path = tmp_path_factory.mktemp("dm-target")
    make_checkpoint("qwen3", path, seed=11)
    return path


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory):
    """A different architecture and weights, on the same 256-token vocabulary."""
    from tests.conftest import make_checkpoint

    path = tmp_path_factory.mktemp("dm-llama")
    make_checkpoint("llama", path, seed=3)
    return path


@pytest.fixture(scope="module")
def near_dir(tmp_path_factory, target_dir):
    """The target with its weights perturbed: a draft that agrees with it often, not always."""
    from tests.conftest import perturbed_checkpoint

    path = tmp_path_factory.mktemp("dm-near")
    perturbed_checkpoint(target_dir, path)
    return path


@pytest.fixture(scope="module")
def plain_traffic(target_dir):
    return _traffic(_engine(target_dir, "eager"), seed=2, n_reqs=8, temperature=0.0)


def _spec(path, k: int = 4, **kw) -> dict:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k} | kw


def _check_pools(llm: LLM) -> None:
    core = llm.engine
    core.scheduler.check_integrity()
    core.drafter.check_integrity()


@pytest.mark.parametrize("mode", ["eager", "ragged"])
@pytest.mark.parametrize("draft", ["self", "other"])
def test_greedy_output_equals_plain_under_preemption(target_dir, other_dir, plain_traffic,
                                                     mode, draft):
    """Random arrivals in a tight pool (preemption, recompute, chunked prefill): greedy
    output equals plain decoding whether the draft agrees (self-drafting: every draft
    accepted) or not (another random model: almost none)."""
    llm = _engine(target_dir, mode, _spec(target_dir if draft == "self" else other_dir))
    assert _traffic(llm, seed=2, n_reqs=8, temperature=0.0) == plain_traffic
    _check_pools(llm)
    assert llm.engine.drafter.num_used_blocks == 0  # every draft block came back
    st = llm.spec_stats()
    assert llm.stats().preemptions > 0 and st["verify_steps"] > 0
    assert st["draft_forwards_per_step"] > 1
    if draft == "self":
        assert st["acceptance_rate"] == 1.0
    else:
        assert st["acceptance_rate"] < 0.2
    if mode != "eager":
        gs = llm.engine.drafter.runner.graphs.stats.as_dict()
        assert sum(gs["hits"].values()) > 0 and gs["checks"] > 0  # the draft's own graphs
        assert not gs["tail_nodes"]  # drafts are never constrained: no tail graphs
        if llm.engine.runner.graphs.whole is not None:
            assert llm.engine.runner.graphs.stats.as_dict()["tail_nodes"]  # the target's


def test_adaptive_budget_speculates_with_a_draft_model(target_dir, plain_traffic):
    """A draft model never coasts (its own KV follows every step), so its engine measures
    plain steps resolved in place; the adaptive budget must then verify self-drafts, which
    are always accepted, and leave the output as plain decoding's."""
    llm = _engine(target_dir, "eager", _spec(target_dir, budget="adaptive"))
    assert _traffic(llm, seed=2, n_reqs=8, temperature=0.0) == plain_traffic
    budget = llm.engine.budget
    assert budget.plain_costs and budget.costs
    st = llm.spec_stats()
    assert st["verify_steps"] > 0 and st["acceptance_rate"] == 1.0
    _check_pools(llm)


def test_prefix_hits_n_and_aborts(target_dir, near_dir):
    kw = dict(num_kv_blocks=40, enable_prefix_caching=True)
    shared = [7, 8, 9, 10] * 8  # two full blocks shared by every prompt
    prompts = [shared + [11 + i, 12, 13] for i in range(3)]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, n=2, ignore_eos=True)
    sampled = [SamplingParams(temperature=0.9, top_k=20, seed=s, max_tokens=16, n=2,
                              ignore_eos=True) for s in range(2)]

    def run(llm):
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        outs += llm.generate(prompts[:1], greedy, use_tqdm=False)  # cached prefixes
        return [[c.token_ids for c in o.outputs] for o in outs]

    expected = run(_engine(target_dir, "eager", **kw))
    llm = _engine(target_dir, "eager", _spec(near_dir), **kw)
    assert run(llm) == expected
    assert llm.stats().prefix_cache_hit_tokens > 0
    assert llm.spec_stats()["accepted_tokens"] > 0
    # Seeded sampling requests are deterministic: a fresh engine gives the same tokens.
    once = llm.generate(prompts[:2], sampled, use_tqdm=False)
    again = _engine(target_dir, "eager", _spec(near_dir), **kw).generate(
        prompts[:2], sampled, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in once] == \
        [[c.token_ids for c in o.outputs] for o in again]
    # Aborts mid-run give every draft block back.
    core = llm.engine
    for i, p in enumerate(prompts):
        core.add_request(f"a{i}", p, SamplingParams(temperature=0.0, max_tokens=40, n=2,
                                                    ignore_eos=True))
    for _ in range(4):
        core.step()
    assert core.drafter.num_used_blocks > 0
    for i in range(len(prompts)):
        core.abort(f"a{i}")
    _check_pools(llm)
    assert core.drafter.num_used_blocks == 0 and core.block_manager.num_used_blocks == 0


def test_confidence_cuts_drafts_per_request(target_dir):
    """Drafts stop at the first token the draft is less sure of than ``draft_confidence``
    (here about the median top probability of the tiny model): lengths vary per request, 0
    included, and the output still equals plain decoding."""
    prompts = [[3 + i, 40 + 2 * i, 90, 17 + i] for i in range(4)]
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    want = [o.outputs[0].token_ids
            for o in _engine(target_dir, "eager").generate(prompts, sp, use_tqdm=False)]
    llm = _engine(target_dir, "eager", _spec(target_dir, draft_confidence=0.018))
    drafter = llm.engine.drafter
    propose = drafter.propose
    lengths: list[int] = []

    def spy(reqs, max_lens):
        out = propose(reqs, max_lens)
        lengths.extend(len(d) for d, k in zip(out, max_lens) if k == 4)
        return out

    drafter.propose = spy
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert got == want
    assert 0 in lengths and 4 in lengths and len(set(lengths)) >= 3, lengths


def test_stop_token_and_max_tokens_inside_an_accepted_run(target_dir):
    prompt = [20, 21, 22, 23] * 3
    plain = _engine(target_dir, "eager", num_kv_blocks=40)
    spec = _engine(target_dir, "eager", _spec(target_dir), num_kv_blocks=40)
    full = plain.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30,
                                                   ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    cases = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (1, 2, 6, 11)]
    cases += [SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[t])
              for t in dict.fromkeys(full[3:12])]
    for sp in cases:
        want = plain.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
        got = spec.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
        assert (got.token_ids, got.finish_reason, got.stop_reason) == \
            (want.token_ids, want.finish_reason, want.stop_reason), sp
    assert spec.spec_stats()["accepted_tokens"] > 10
    _check_pools(spec)
    assert spec.engine.drafter.num_used_blocks == 0


# 99.9th percentile of chi-square with 3 degrees of freedom.
CHI2_3_999 = 16.27


def _top4(llm: LLM, prompt: list[int]) -> dict[int, float]:
    """The top-4 distribution (temperature 1) of ``llm``'s next token after ``prompt``."""
    sp = SamplingParams(temperature=0.0, max_tokens=1, logprobs=4)
    lp = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0].logprobs[0].top
    z = sum(torch.tensor(list(lp.values())).exp().tolist())
    return {t: float(torch.tensor(v).exp()) / z for t, v in lp.items()}


def test_rejection_sampling_through_the_draft_model_keeps_the_target_distribution(
        target_dir, near_dir):
    """Output 1 of requests sampling with top_k=4 is a verify row (one draft from a draft
    model close to the target): conditioned on output 0, it is distributed as the target's
    top-4 distribution, and drafts are accepted at the rate sum(min(p, q))."""
    prompt = [5, 6, 7, 8, 9]
    n = 1200
    kw = dict(num_kv_blocks=200, max_num_seqs=128, max_num_batched_tokens=256)
    llm = _engine(target_dir, "eager", _spec(near_dir, k=1), **kw)
    sps = [SamplingParams(temperature=1.0, top_k=4, seed=i, max_tokens=3, ignore_eos=True)
           for i in range(n)]
    outs = [o.outputs[0].token_ids for o in llm.generate([prompt] * n, sps, use_tqdm=False)]
    st = llm.spec_stats()
    assert st["draft_tokens"] == n  # every request verified one draft at output 1
    plain = _engine(target_dir, "eager", **kw)
    draft = _engine(near_dir, "eager", **kw)
    firsts = torch.tensor([o[0] for o in outs])
    expected_accepts = 0.0
    for t0 in firsts.unique().tolist():
        p = _top4(plain, prompt + [t0])
        q = _top4(draft, prompt + [t0])
        share = float((firsts == t0).sum())
        expected_accepts += share * sum(min(p[t], q.get(t, 0.0)) for t in p)
        if share < 200:
            continue
        seconds = [o[1] for o in outs if o[0] == t0]
        counts = torch.tensor([seconds.count(t) for t in p], dtype=torch.float64)
        assert sum(counts) == len(seconds)  # nothing outside the target's top 4
        exp = torch.tensor(list(p.values()), dtype=torch.float64) * len(seconds)
        assert float(((counts - exp) ** 2 / exp).sum()) < CHI2_3_999, (counts, exp)
    rate = expected_accepts / n
    assert 0.2 < rate < 0.98  # q differs from p, and overlaps it
    sigma = (rate * (1 - rate) / n) ** 0.5
    assert abs(st["acceptance_rate"] - rate) < 4.5 * sigma, (st["acceptance_rate"], rate)


def test_a_draft_model_with_another_vocabulary_is_refused(target_dir, tmp_path):
    from tests.conftest import make_checkpoint

    make_checkpoint("qwen3", tmp_path, seed=1, vocab_size=300)
    with pytest.raises(ValueError, match=r"speculative_config\['model'\]=.*vocabulary has 300 "
                                         "tokens, the target's 256"):
        _engine(target_dir, "eager", _spec(tmp_path))
    with pytest.raises(ValueError, match=r"speculative_config\['num_speculative_tokens'\]=32"):
        _engine(target_dir, "ragged", _spec(target_dir, k=32))  # top tier 32 < 33


def test_tokenizer_ids_and_positions_are_checked():
    target, _ = load_model_config("llama3-8b")
    small, _ = load_model_config("llama3.2-1b")
    check_draft_model("llama3.2-1b", small, None, target, None, 8192)  # the bench pairing
    qwen, _ = load_model_config("qwen3-0.6b")
    with pytest.raises(ValueError, match="vocabulary has 151936 tokens, the target's 128256"):
        check_draft_model("qwen3-0.6b", qwen, None, target, None, 8192)
    with pytest.raises(ValueError, match="reaches 8192 positions, fewer than max_model_len"):
        check_draft_model("llama3-8b", target, None, small, None, 10000)
    from replaylm.engine import draft_runner as draft_model

    def tok(vocab):
        return SimpleNamespace(get_vocab=lambda: vocab)

    orig = draft_model._tokenizer_of
    try:
        draft_model._tokenizer_of = lambda d, w: tok({"a": 0, "b": 1})
        check_draft_model("x", small, None, target, tok({"a": 0, "b": 1}), 8192)
        with pytest.raises(ValueError, match=r"maps tokens to other ids than the target's"):
            check_draft_model("x", small, None, target, tok({"a": 1, "b": 0}), 8192)
    finally:
        draft_model._tokenizer_of = orig


def test_the_built_in_model_drafts_for_itself_with_its_tokenizer():
    """A checkpoint with a tokenizer: ids are compared, and a stop string completed inside an
    accepted run ends the output there, as in plain decoding."""
    args = dict(num_kv_blocks=48, max_num_seqs=4, max_model_len=256, enforce_eager=True)
    plain = LLM("default", **args)
    spec = LLM("default", speculative_config=_spec("default"), **args)
    prompt = "one two three one two three"
    sp = dict(temperature=0.0, max_tokens=30, ignore_eos=True)
    base = plain.generate([prompt], SamplingParams(**sp), use_tqdm=False)[0].outputs[0]
    stop = plain.get_tokenizer().decode(base.token_ids[4:5]).strip()
    assert stop
    for m in (2, 5, 9):
        p = SamplingParams(**sp, stop=[stop], min_tokens=m)
        want = plain.generate([prompt], p, use_tqdm=False)[0].outputs[0]
        got = spec.generate([prompt], p, use_tqdm=False)[0].outputs[0]
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == \
            (want.token_ids, want.text, want.finish_reason, want.stop_reason)
    assert spec.spec_stats()["acceptance_rate"] == 1.0
    assert spec.engine.drafter.num_used_blocks == 0
