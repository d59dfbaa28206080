"""Pipelined verify steps (``speculative.pipeline``): two cohorts take turns, one in flight
while the other's step is built, and the output equals plain decoding token for token."""

from __future__ import annotations

import pytest

from replaylm import SamplingParams
from replaylm.engine.request import Request
from replaylm.speculative import pipeline as pipeline_mod
from replaylm.speculative.pipeline import COOLDOWN, WARMUP, VerifyPipeline
from tests.engine.scheduler_helpers import make_req, make_sched
from tests.speculative.test_spec_engine import NGRAM, _engine, _traffic

PIPELINED = NGRAM | {"pipeline": "on"}


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    from tests.conftest import make_checkpoint

    path = tmp_path_factory.mktemp("pipeline-qwen3")
    make_checkpoint("qwen3", path, seed=11)
    return path


def _watch(core) -> list[tuple[list[Request], bool]]:
    """Each launched step's requests, and whether it verified drafts and stayed in flight."""
    seen: list[tuple[list[Request], bool]] = []
    step = core.speculation.step

    def watched():
        launched, deltas = step()
        if launched is not None:
            verified = any(s.drafts for s in launched.out.scheduled)
            seen.append(([s.request for s in launched.out.scheduled],
                         verified and core.inflight is launched))
        return launched, deltas

    core.speculation.step = watched
    return seen


@pytest.mark.parametrize("mode", ["eager", "ragged"])
def test_pipelined_verify_matches_plain(qwen3_dir, mode):
    """Greedy and seeded requests, chunked prefills, preemptions: the same tokens as plain
    decoding, with verify steps left in flight (``_traffic`` checks the scheduler's books
    every step and that no block leaks)."""
    expected = _traffic(_engine(qwen3_dir, "eager"))
    llm = _engine(qwen3_dir, mode, PIPELINED)
    seen = _watch(llm.engine)
    assert _traffic(llm) == expected
    st = llm.spec_stats()
    assert st["pipelined_steps"] > 0 and st["accepted_tokens"] > 0
    assert sum(pipelined for _, pipelined in seen) == st["pipelined_steps"]
    assert llm.stats().preemptions > 0


def test_two_cohorts_alternate(qwen3_dir):
    """Four equal requests, every draft right: after the prefills the verify steps take
    two requests each, the two halves in turn, each left in flight while the other's
    step is built; the tokens are the plain run's."""
    from replaylm.bench.spec_drafters import ControlledDrafter

    prompts = [[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16], [17, 18, 19, 20]]
    sp = SamplingParams(temperature=0.0, max_tokens=21, ignore_eos=True)
    plain = _engine(qwen3_dir, "eager")
    refs = {tuple(p): o.outputs[0].token_ids
            for p, o in zip(prompts, plain.generate(prompts, sp, use_tqdm=False))}
    llm = _engine(qwen3_dir, "eager", PIPELINED)
    core = llm.engine
    core.use_drafter(ControlledDrafter(refs, 1.0, int(llm.model_config.vocab_size), 0))
    seen = _watch(core)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [refs[tuple(p)] for p in prompts]
    verifies = [(frozenset(r.request_id for r in reqs), kept) for reqs, kept in seen
                if len(reqs) == 2]
    assert len(verifies) >= 6 and all(kept for _, kept in verifies[:-1])
    first, second = verifies[0][0], verifies[1][0]
    assert not first & second and len(first | second) == 4
    assert [ids for ids, _ in verifies] == [(first, second)[i % 2] for i in range(len(verifies))]
    assert core.block_manager.num_used_blocks == 0


def test_abort_while_its_cohort_is_in_flight(qwen3_dir):
    llm = _engine(qwen3_dir, "eager", PIPELINED)
    core = llm.engine
    sp = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    for i in range(4):
        core.add_request(str(i), [40 + i, 41, 42] * 6, sp)
    for _ in range(50):
        core.step()
        flying = core.inflight
        if flying is not None and any(s.drafts for s in flying.out.scheduled):
            break
    else:
        pytest.fail("no verify step was left in flight")
    victim = flying.out.scheduled[0].request
    assert core.abort(victim.parent_id)
    done = {}
    while core.has_unfinished():
        for d in core.step():
            done.setdefault(d.request_id, d.finished)
        core.scheduler.check_integrity()
    assert victim.parent_id not in done and len(done) == 3
    assert core.block_manager.num_used_blocks == 0


def test_adaptive_budget_verifies_in_cohorts(qwen3_dir, monkeypatch):
    """Pipelined, the adaptive budget chooses each cohort's drafts by what pipelined steps
    cost (``cohort_costs``) against plain decoding of every request: with synchronous
    verifies priced out and cohorts paying, the steps verify in cohorts; once cohorts stop
    paying, coasting starts. Output equals plain decoding throughout, the scheduler's books
    hold every step and no block leaks."""
    from replaylm.bench.spec_drafters import ControlledDrafter

    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16], [17, 18]]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    refs = {tuple(p): o.outputs[0].token_ids
            for p, o in zip(prompts, _engine(qwen3_dir, "eager").generate(prompts, sp,
                                                                          use_tqdm=False))}
    llm = _engine(qwen3_dir, "eager", PIPELINED | {"budget": "adaptive"})
    core, budget = llm.engine, llm.engine.budget
    # Costs fixed (CPU step times would make it flaky): a synchronous verify never pays
    # (5 against 1 for a plain step of every request), a cohort's does (0.6).
    monkeypatch.setattr(budget, "observe_step", lambda *a, **k: None)
    budget.plain_costs = dict.fromkeys(budget.tiers, 1.0)
    budget.costs = dict.fromkeys(budget.tiers, 5.0)
    budget.cohort_costs = dict.fromkeys(budget.tiers, 0.6)
    budget.coasting, budget.hold = False, 0
    core.use_drafter(ControlledDrafter(refs, 1.0, int(llm.model_config.vocab_size), 0))
    step, launched = core.speculation.step, []

    def watched():
        out = step()
        launched.append(out[0] is not None)
        core.scheduler.check_integrity()
        if sum(launched) == 8:  # cohorts stop paying: the next choice starts coasting
            budget.cohort_costs = dict.fromkeys(budget.tiers, 5.0)
        return out

    core.speculation.step = watched
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, outs)} == refs
    st = llm.spec_stats()
    assert st["pipelined_steps"] >= 3 and st["accepted_tokens"] > 0 and st["coast_steps"] > 0
    assert core.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("spec, kw", [
    (NGRAM, {}),  # auto: the CPU runs each step inside its launch, nothing would overlap
    (NGRAM | {"pipeline": "off"}, {}),
    (PIPELINED, {"overlap_scheduling": False}),
])
def test_when_verify_steps_do_not_pipeline(qwen3_dir, spec, kw):
    llm = _engine(qwen3_dir, "eager", spec, **kw)
    assert llm.engine.speculation.pipeline is None
    llm.generate([[40, 41, 42] * 6] * 3, SamplingParams(temperature=0.0, max_tokens=12,
                                                      ignore_eos=True), use_tqdm=False)
    assert llm.spec_stats()["pipelined_steps"] == 0


def _steps_to_switch(p: VerifyPipeline, host: float, wait: float, most: int = 500) -> int:
    """Observe ``(host, wait)`` until ``p`` changes mode; the steps it took."""
    was = p.active
    for n in range(1, most + 1):
        p.observe(host, wait)
        if p.active != was:
            return n
    return most + 1


def test_the_rule_follows_host_time_against_the_wait():
    p = VerifyPipeline("auto")
    assert _steps_to_switch(p, 2e-3, 1e-3) == WARMUP  # host-bound: pipeline
    assert _steps_to_switch(p, 1.05e-3, 1e-3, most=200) == 201  # within the margin: stays
    assert _steps_to_switch(p, 0.5e-3, 1e-3) < 20  # the device is the bottleneck: leave
    assert p.cooldown == COOLDOWN
    # After the cooldown, WARMUP steps are measured afresh before it may pipeline again.
    assert _steps_to_switch(p, 2e-3, 1e-3) == COOLDOWN + WARMUP
    _steps_to_switch(p, 0.5e-3, 1e-3)
    assert p.cooldown == 2 * COOLDOWN and p.switches == 4  # twice as long after another exit
    p.next_cooldown = pipeline_mod.MAX_COOLDOWN
    p.cooldown = 0
    _steps_to_switch(p, 2e-3, 1e-3)
    _steps_to_switch(p, 0.5e-3, 1e-3)
    assert p.next_cooldown == pipeline_mod.MAX_COOLDOWN


def test_a_synchronous_step_past_the_graphs_pipelines():
    """Where a synchronous verify would run eagerly past the graphed tiers and a cohort's
    would not, the engine pipelines at once (even in a cooldown) and stays while that holds,
    however long it waits for the device; then the timing rule takes over afresh."""
    p = VerifyPipeline("auto")
    p.cooldown = COOLDOWN
    p.observe(0.5e-3, 10e-3, sync_eager=True)
    assert p.active and p.cooldown == 0
    for _ in range(4 * WARMUP):
        p.observe(0.5e-3, 10e-3, sync_eager=True)
    assert p.active and p.switches == 1
    assert _steps_to_switch(p, 0.5e-3, 10e-3) == WARMUP  # device-bound, graphed: leave


def test_which_synchronous_steps_would_run_eagerly(qwen3_dir):
    """Judged from a verify step's tokens against the top graphed tier: a synchronous step
    of all requests past it, with half of them within it; fixed K only."""
    from types import SimpleNamespace

    def step(tokens):
        return SimpleNamespace(out=SimpleNamespace(num_batched_tokens=tokens))

    spec = _engine(qwen3_dir, "ragged", NGRAM).engine.speculation
    top = spec._graph_top
    assert top > 0
    assert not spec._sync_eager(step(top), pipelined=False)
    assert spec._sync_eager(step(top + 2), pipelined=False)
    assert not spec._sync_eager(step(2 * top + 2), pipelined=False)  # a cohort's too
    assert spec._sync_eager(step(top // 2 + 1), pipelined=True)
    assert not spec._sync_eager(step(top // 2), pipelined=True)
    adaptive = _engine(qwen3_dir, "ragged", NGRAM | {"budget": "adaptive"})
    assert not adaptive.engine.speculation._sync_eager(step(top + 2), pipelined=False)
    assert _engine(qwen3_dir, "eager", NGRAM).engine.speculation._graph_top == 0


def test_forced_pipeline_never_leaves():
    p = VerifyPipeline("on")
    for _ in range(4 * WARMUP):
        p.observe(0.1e-3, 5e-3)
    assert p.active and p.switches == 0


@pytest.mark.parametrize("busy, ready, take", [
    (0, 64, 32), (32, 32, 32), (30, 40, 35), (0, 1, 1), (5, 1, 1), (0, 0, 0), (0, 3, 2)])
def test_cohort_size(busy, ready, take):
    assert VerifyPipeline.cohort(busy, ready) == take


def test_held_requests_sit_the_step_out():
    """A held decoder is not scheduled and does not count as decoding: with the only decoder
    held, a prompt may use the whole budget rather than ``max_mixed_prefill_tokens``."""
    def decoder_and_prompt():
        sched = make_sched(max_num_batched_tokens=64, max_mixed_prefill_tokens=8)
        a, b = make_req("a", 4), make_req("b", 40)
        sched.add(a)
        out = sched.schedule()
        sched.launched(out)
        sched.update(out, [3])
        sched.add(b)
        return sched, a, b

    sched, a, b = decoder_and_prompt()
    assert [(s.request, s.num_new_tokens) for s in sched.schedule().scheduled] == [
        (a, 1), (b, 8)]
    sched, a, b = decoder_and_prompt()
    assert [(s.request, s.num_new_tokens) for s in sched.schedule(hold={a}).scheduled] == [
        (b, 40)]


def test_step_uploads_stage_a_steps_rows_in_one_row():
    import numpy as np
    import torch

    from replaylm.graphs.buffers import StepUploads

    up = StepUploads(8, torch.device("cpu"))
    a, b = np.array([3, 1, 4], dtype=np.int64), np.array([1, 5], dtype=np.int64)
    got = up.upload(a, None, b)
    assert got[1] is None and got[0].tolist() == [3, 1, 4] and got[2].tolist() == [1, 5]
    assert got[0].data_ptr() == up._dev.data_ptr()  # staged: views of the one device row
    big = np.arange(9, dtype=np.int64)
    (over,) = up.upload(big)  # past capacity: its own copy
    assert over.tolist() == big.tolist() and over.data_ptr() != up._dev.data_ptr()
