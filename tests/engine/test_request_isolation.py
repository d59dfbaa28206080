"""A failure that belongs to one request finishes that request alone (finish_reason "error");
every other request completes token for token as if it had run without it."""

from __future__ import annotations

import pytest

from replaylm import LLM, SamplingParams

PROMPTS = ["def main():", "import os", "class Foo:", "for i in range(10):"]
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.9, seed=1, max_tokens=10, ignore_eos=True),
    SamplingParams(temperature=0.7, seed=2, top_k=20, max_tokens=14, ignore_eos=True,
                   presence_penalty=0.5),
    SamplingParams(temperature=1.0, seed=3, max_tokens=9, ignore_eos=True, stop=["zzzz"]),
]
VICTIM = SamplingParams(temperature=0.8, seed=666, max_tokens=12, ignore_eos=True,
                        stop=["qqqq"])


@pytest.fixture(scope="module", params=[True, False], ids=["overlap", "no-overlap"])
def llm(request):
    return LLM("default", max_num_seqs=8, num_kv_blocks=96, max_model_len=256,
               overlap_scheduling=request.param)


@pytest.fixture(scope="module")
def reference(llm):
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _run(core, victim_hook=None) -> dict[str, object]:
    """Add the four requests and the victim between them; step to the end; return each
    request's tokens, finish reason and error."""
    ids = ["a", "b", "victim", "c", "d"]
    prompts = PROMPTS[:2] + ["while True:"] + PROMPTS[2:]
    params = PARAMS[:2] + [VICTIM] + PARAMS[2:]
    for rid, prompt, sp in zip(ids, prompts, params):
        core.add_request(rid, prompt, sp)
    if victim_hook is not None:
        victim_hook(core, core.requests["victim"][0])
    got = {rid: {"tokens": [], "finish": None, "error": None} for rid in ids}
    while core.has_unfinished():
        for d in core.step():
            g = got[d.request_id]
            g["tokens"] += d.new_token_ids
            if d.finished:
                g["finish"], g["error"] = d.finish_reason, d.error
        core.scheduler.check_integrity()
    assert core.block_manager.num_used_blocks == 0
    assert not core.requests and not core.outputs
    return got


def _check(got, reference, where: str) -> None:
    for rid, ref in zip(["a", "b", "c", "d"], reference):
        assert got[rid]["tokens"] == ref, rid
        assert got[rid]["finish"] == "length", rid
    assert got["victim"]["finish"] == "error"
    assert "injected" in got["victim"]["error"] and where in got["victim"]["error"]


def _break_victim_slot(llm, monkeypatch, message: str) -> None:
    """Make writing the victim's sampling settings into its slot raise ``message``."""
    state = llm.engine.runner.sampler.state
    real_set = state.set

    def set_(slot, params, seed):
        if params.seed == VICTIM.seed:
            raise RuntimeError(message)
        return real_set(slot, params, seed)

    monkeypatch.setattr(state, "set", set_)


def test_fault_writing_one_slot(llm, reference, monkeypatch) -> None:
    _break_victim_slot(llm, monkeypatch, "injected: slot write")
    failed = llm.stats().requests_failed
    _check(_run(llm.engine), reference, "slot write")
    assert llm.stats().requests_failed == failed + 1


@pytest.mark.parametrize("part", ["detok", "stop"])
def test_fault_in_one_requests_output_processing(llm, reference, part) -> None:
    def hook(core, req):
        state = core.outputs[req]
        target = state.detok if part == "detok" else state.stop
        real = target.step if part == "detok" else target.push
        calls = []

        def broken(*args, **kwargs):
            calls.append(1)
            if len(calls) == 3:  # a few tokens in, mid-stream
                raise ValueError(f"injected: {part}")
            return real(*args, **kwargs)

        setattr(target, "step" if part == "detok" else "push", broken)

    _check(_run(llm.engine, hook), reference, part)


def test_generate_reports_error_and_the_rest(llm, reference, monkeypatch) -> None:
    _break_victim_slot(llm, monkeypatch, "injected: offline")
    outs = llm.generate(PROMPTS + ["x"], PARAMS + [VICTIM], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:4]] == reference
    victim = outs[4].outputs[0]
    assert victim.finish_reason == "error" and "injected: offline" in victim.error
    assert outs[4].finished


def test_engine_fault_fails_the_call_and_leaves_nothing_running(llm, monkeypatch) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("injected: device fault")

    monkeypatch.setattr(llm.engine.runner, "execute", broken)
    with pytest.raises(RuntimeError, match="device fault"):
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    monkeypatch.undo()
    assert not llm.engine.has_unfinished()
    assert llm.engine.block_manager.num_used_blocks == 0
