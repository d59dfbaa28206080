"""Speculative decoding through the engine: output equals plain decoding token for token."""

from __future__ import annotations

import copy

import pytest
import torch

from replaylm import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    from tests.conftest import make_checkpoint

    path = tmp_path_factory.mktemp("spec-qwen3")
    make_checkpoint("qwen3", path, seed=11)
    return path


def _engine(path, mode, spec=None, **kw):
    args = dict(num_kv_blocks=10, max_num_seqs=6, max_num_batched_tokens=40, max_model_len=128,
                max_graph_tokens=32, skip_tokenizer_init=True, attention_backend="torch_dense",
                speculative_config=spec)
    if mode == "eager":
        return LLM(str(path), enforce_eager=True, **(args | kw))
    graph = dict(cuda_graph_mode=mode, graph_check=1, poison_padding=True)
    return LLM(str(path), **(args | graph | kw))


def _prompt(g: torch.Generator, i: int) -> list[int]:
    """Every other prompt repeats a span (n-gram drafts find matches); the rest are random."""
    n = int(torch.randint(2, 30, (1,), generator=g))
    if i % 2:
        return torch.randint(3, 256, (n,), generator=g).tolist()
    span = torch.randint(3, 256, (int(torch.randint(2, 6, (1,), generator=g)),),
                         generator=g).tolist()
    return (span * 12)[:n + 4]


def _traffic(llm: LLM, seed: int = 0, n_reqs: int = 10, **sp_kw) -> dict[str, list[int]]:
    """Random arrivals: chunked prefills, decodes, verifies and preemptions in one run."""
    g = torch.Generator().manual_seed(seed)
    core = llm.engine
    arrivals: dict[int, list[int]] = {}
    for i in range(n_reqs):
        arrivals.setdefault(int(torch.randint(0, 12, (1,), generator=g)), []).append(i)
    got: dict[str, list[int]] = {}
    step = 0
    while step < 12 or core.has_unfinished():
        for i in arrivals.get(step, []):
            sp = dict(temperature=0.0 if i % 3 else 0.8, seed=i,
                      max_tokens=int(torch.randint(1, 40, (1,), generator=g)), ignore_eos=True)
            core.add_request(str(i), _prompt(g, i), SamplingParams(**(sp | sp_kw)))
            got[str(i)] = []
        for d in core.step():
            got[d.request_id].extend(d.new_token_ids)
        core.scheduler.check_integrity()
        step += 1
    assert core.block_manager.num_used_blocks == 0
    return got


@pytest.mark.parametrize("mode", ["eager", "ragged", "piecewise", "full", "full_and_piecewise"])
def test_spec_matches_plain_under_preemption(qwen3_dir, mode):
    expected = _traffic(_engine(qwen3_dir, "eager"))
    llm = _engine(qwen3_dir, mode, NGRAM)
    assert _traffic(llm) == expected
    st = llm.spec_stats()
    assert st["verify_steps"] > 0 and st["accepted_tokens"] > 0
    assert st["accepted_tokens"] < st["draft_tokens"]  # some drafts were rejected too
    assert llm.stats().preemptions > 0  # the pool is tight enough to preempt
    if mode != "eager":
        gs = llm.graph_stats()
        assert gs["checks"] > 0 and sum(gs["hits"].values()) > 0


@pytest.mark.parametrize("pipeline", ["off", "on"])
def test_spec_with_prefix_hits_and_n(qwen3_dir, pipeline):
    kw = dict(num_kv_blocks=40, enable_prefix_caching=True)
    shared = [7, 8, 9, 10] * 9  # two full blocks shared by every prompt
    prompts = [shared + [11 + i, 12, 13] * 3 for i in range(4)]
    sps = [SamplingParams(temperature=t, seed=3, max_tokens=30, n=2, ignore_eos=True)
           for t in (0.0, 0.7, 0.0, 0.7)]

    def run(llm):
        outs = llm.generate(prompts, sps, use_tqdm=False)
        outs += llm.generate(prompts[:2], sps[:2], use_tqdm=False)  # cached prefixes
        return [[c.token_ids for c in o.outputs] for o in outs]

    expected = run(_engine(qwen3_dir, "eager", **kw))
    llm = _engine(qwen3_dir, "ragged", NGRAM | {"pipeline": pipeline}, **kw)
    assert run(llm) == expected
    assert llm.stats().prefix_cache_hit_tokens > 0
    assert llm.spec_stats()["accepted_tokens"] > 0
    assert (llm.spec_stats()["pipelined_steps"] > 0) == (pipeline == "on")


def test_stop_token_and_max_tokens_inside_an_accepted_run(qwen3_dir):
    prompt = [20, 21, 22, 23] * 6
    plain = _engine(qwen3_dir, "eager", num_kv_blocks=40)
    spec = _engine(qwen3_dir, "eager", NGRAM, num_kv_blocks=40)
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    full = plain.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert spec.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids == full
    assert spec.spec_stats()["accepted_tokens"] >= 5  # verifies emit runs of tokens
    cases = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
             for m in range(1, 14)]
    cases += [SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[t])
              for t in dict.fromkeys(full[2:20])]
    for sp in cases:
        want = plain.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
        got = spec.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
        assert (got.token_ids, got.finish_reason, got.stop_reason) == \
            (want.token_ids, want.finish_reason, want.stop_reason), sp
    assert spec.engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("pipeline", ["off", "on"])
def test_logprobs_match_plain(qwen3_dir, pipeline):
    prompts = [[30, 31, 32] * 8, [40, 41] * 10, [50, 51, 52, 53] * 5]
    sp = SamplingParams(temperature=0.0, max_tokens=20, logprobs=2, ignore_eos=True)
    wants = _engine(qwen3_dir, "eager").generate(prompts, sp, use_tqdm=False)
    llm = _engine(qwen3_dir, "eager", NGRAM | {"pipeline": pipeline})
    for got, want in zip(llm.generate(prompts, sp, use_tqdm=False), wants):
        got, want = got.outputs[0], want.outputs[0]
        assert got.token_ids == want.token_ids
        assert len(got.logprobs) == len(want.logprobs) == len(want.token_ids)
        for a, b in zip(got.logprobs, want.logprobs):
            assert (a.token_id, a.rank, a.top.keys()) == (b.token_id, b.rank, b.top.keys())
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            for t in a.top:
                assert a.top[t] == pytest.approx(b.top[t], abs=1e-4)
    assert llm.spec_stats()["accepted_tokens"] > 0
    assert (llm.spec_stats()["pipelined_steps"] > 0) == (pipeline == "on")


def test_speculation_is_off_by_default(qwen3_dir):
    llm = _engine(qwen3_dir, "eager")
    llm.generate([[5, 6, 5, 6, 5, 6]], SamplingParams(max_tokens=5), use_tqdm=False)
    assert llm.spec_stats() == {} and llm.engine.drafter is None


def test_start_up_refuses_drafts_the_top_tier_cannot_verify(qwen3_dir):
    spec = {"method": "ngram", "num_speculative_tokens": 32}
    with pytest.raises(ValueError, match=r"speculative_config\['num_speculative_tokens'\]=32"):
        _engine(qwen3_dir, "ragged", spec)  # top tier 32 < 33


def test_stop_string_inside_an_accepted_run():
    """A stop string completed by a token inside a verified run ends the output there, as
    in plain decoding (the built-in model, with its tokenizer)."""
    args = dict(num_kv_blocks=48, max_num_seqs=4, max_model_len=256, enforce_eager=True)
    plain, spec = LLM("default", **args), LLM("default", speculative_config=NGRAM, **args)
    prompt = "one two three one two three one two three one two"
    sp = dict(temperature=0.0, max_tokens=40, ignore_eos=True)
    base = plain.generate([prompt], SamplingParams(**sp), use_tqdm=False)[0].outputs[0]
    assert spec.generate([prompt], SamplingParams(**sp), use_tqdm=False)[0].outputs[0] \
        .token_ids == base.token_ids
    assert spec.spec_stats()["accepted_tokens"] > 0
    tok = plain.get_tokenizer()
    cut_inside_run = 0
    # The output repeats, so a stop string taken from it matches at once: min_tokens moves
    # the first position it may end at across the verified runs.
    stop = tok.decode(base.token_ids[5: 6]).strip()
    assert stop
    for m in range(3, 16):
        p = SamplingParams(**sp, stop=[stop], min_tokens=m)
        want = plain.generate([prompt], p, use_tqdm=False)[0].outputs[0]
        core = spec.engine
        core.add_request("s", prompt, p)
        got_ids, got_text, last = [], "", None
        while core.has_unfinished():
            for d in core.step():
                got_ids += d.new_token_ids
                got_text += d.new_text
                last = d
        assert (got_ids, got_text, last.finish_reason, last.stop_reason) == \
            (want.token_ids, want.text, want.finish_reason, want.stop_reason), stop
        assert core.block_manager.num_used_blocks == 0
        cut_inside_run += core.spec_stats.accepted_tokens > 0 and len(last.new_token_ids) > 1
    assert cut_inside_run > 0  # some stop string ended a multi-token verify


@pytest.mark.parametrize("mode", ["eager", "ragged"])
def test_adaptive_budget_matches_plain(qwen3_dir, mode):
    expected = _traffic(_engine(qwen3_dir, "eager"), seed=1, n_reqs=6)
    llm = _engine(qwen3_dir, mode, NGRAM | {"budget": "adaptive"})
    assert _traffic(llm, seed=1, n_reqs=6) == expected
    st = llm.spec_stats()
    assert st["budget"] == "adaptive" and st["verify_steps"] > 0
    assert llm.engine.budget.costs  # step costs were measured


@pytest.mark.parametrize("mode", ["eager", "ragged"])
def test_adaptive_coasting_overlaps_plain_steps(qwen3_dir, mode, monkeypatch):
    """Coasting runs plain steps with overlap (a step left in flight), learns acceptance from
    shadow proposals, goes back to verifying where n-gram drafts match, and never changes
    the output."""
    from replaylm.speculative import adaptive

    monkeypatch.setattr(adaptive, "SHADOW_EVERY", 1)
    expected = _traffic(_engine(qwen3_dir, "eager"), seed=2, n_reqs=8)
    llm = _engine(qwen3_dir, mode, NGRAM | {"budget": "adaptive"})
    core = llm.engine
    assert core.overlap
    core.budget.coasting = True
    in_flight, coasting = [], [True]
    step = core.step

    def watched():
        deltas = step()
        in_flight.append(core.inflight is not None)
        coasting.append(core.budget.coasting)
        return deltas

    core.step = watched
    assert _traffic(llm, seed=2, n_reqs=8) == expected
    st = llm.spec_stats()
    assert st["coast_steps"] > 0 and st["verify_steps"] > 0 and any(in_flight)
    # Shadow proposals ended a coasting stretch (the n-gram drafts of repeated spans match).
    assert any(a and not b for a, b in zip(coasting, coasting[1:]))
    assert core.block_manager.num_used_blocks == 0


def test_adaptive_budget_keeps_verifying_across_requests(qwen3_dir, monkeypatch):
    """A prefill step and a request's last token leave the chooser nothing to decide, so
    they must not start coasting: at batch 1 every new request would otherwise decode
    plainly until shadow evidence ended the stretch."""
    from replaylm.bench.spec_drafters import ControlledDrafter

    llm = _engine(qwen3_dir, "eager", NGRAM | {"budget": "adaptive"})
    core, budget = llm.engine, llm.engine.budget
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    refs = {tuple(p): o.outputs[0].token_ids
            for p, o in zip(prompts, llm.generate(prompts, sp, use_tqdm=False))}
    # Costs fixed where verifying every draft pays (CPU step times would make it flaky).
    monkeypatch.setattr(budget, "observe_step", lambda *a, **k: None)
    budget.plain_costs = dict.fromkeys(budget.tiers, 1.0)
    budget.costs = dict.fromkeys(budget.tiers, 1.2)
    budget.coasting, budget.hold = False, 0
    core.use_drafter(ControlledDrafter(refs, 1.0, int(llm.model_config.vocab_size), 0))
    start = copy.copy(core.spec_stats)
    for prompt in prompts * 2:
        before = llm.spec_stats()
        out = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids
        after = llm.spec_stats()
        assert out == refs[tuple(prompt)]
        assert after["coast_steps"] == before["coast_steps"]
        # Every draft right: 23 tokens after the prefill's, 4 drafts + 1 per verify.
        assert after["verify_steps"] - before["verify_steps"] == 5
        assert not budget.coasting
    # What the budget expected of its verify steps, beside what they did: each priced at
    # its tier's 1.2 s and expected to emit up to 5 tokens (4 drafts). A request's first
    # verify resolves the prefill left in flight first, so it is not measured: the other
    # four (5, 5, 5 and 3 tokens) are.
    st = {f: getattr(core.spec_stats, f) - getattr(start, f) for f in (
        "chosen_steps", "expected_tokens", "priced_seconds", "measured_steps",
        "measured_tokens", "measured_seconds")}
    assert st["chosen_steps"] == 20 and st["measured_steps"] == 16
    assert st["priced_seconds"] == pytest.approx(20 * 1.2)
    assert 20 < st["expected_tokens"] <= 20 * 5
    assert st["measured_tokens"] == 4 * 18
    assert 0 < st["measured_seconds"] < 16 * 1.2


def test_spec_stats_reach_the_metrics(qwen3_dir):
    pytest.importorskip("prometheus_client")
    from replaylm.server.metrics import ServerMetrics

    llm = _engine(qwen3_dir, "eager", NGRAM)
    llm.generate([[40, 41, 42] * 6], SamplingParams(temperature=0.0, max_tokens=16,
                                                    ignore_eos=True), use_tqdm=False)
    values = {}
    for line in ServerMetrics(lambda: llm.engine.stats, lambda: 0).render().decode().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    st = llm.spec_stats()
    assert values["replaylm_spec_accepted_tokens_total"] == st["accepted_tokens"] > 0
    assert values["replaylm_spec_mean_accepted_length"] == pytest.approx(
        st["mean_accepted_length"])
    assert llm.stats().as_dict()["spec"]["draft_tokens"] == st["draft_tokens"]
    plain_stats = _engine(qwen3_dir, "eager").engine.stats
    plain = ServerMetrics(lambda: plain_stats, lambda: 0).render()
    assert b"replaylm_spec_" not in plain


def test_full_mode_verifies_eagerly_whatever_its_decode_tiers(qwen3_dir):
    # One request slot: full graphs stop at batch 1, yet 4 drafts verify (eagerly).
    llm = _engine(qwen3_dir, "full", NGRAM, max_num_seqs=1)
    out = llm.generate([[50, 51] * 8], SamplingParams(temperature=0.0, max_tokens=12,
                                                      ignore_eos=True), use_tqdm=False)
    want = _engine(qwen3_dir, "eager", max_num_seqs=1).generate(
        [[50, 51] * 8], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        use_tqdm=False)
    assert out[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    assert llm.spec_stats()["verify_steps"] > 0
    assert "not a uniform decode batch" in llm.graph_stats()["fallbacks"]
