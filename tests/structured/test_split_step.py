"""A constrained step in two halves (``structured.masks``, ``graphs.whole``): its forward is
launched before the step in flight is waited for, the grammars advance and the masks are
filled after that wait (while a worker thread applies the step in flight), and its tail
(mask, sampler) comes last; outputs are those of an eager engine without overlap
scheduling, in every graph mode (CPU stand-in, with graph checks and poisoned padding on),
with constrained and unconstrained requests mixed, and through speculative verify steps."""

from __future__ import annotations

import json
import re
import threading

import pytest

import replaylm.graphs.whole as whole
from replaylm import LLM, SamplingParams
from replaylm.sampling_params import StructuredOutputsParams as SO

MODES = ["eager", "full", "piecewise", "full_and_piecewise", "ragged"]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "t": {"enum": ["x", "y"]}},
          "required": ["a", "t"], "additionalProperties": False}
REGEX = r"[a-z]{3}-[0-9]{2}"
CHOICES = ["red", "green", "blue"]
GRAMMAR = 'root ::= "(" [0-9] ("+" [0-9]){0,3} ")"'


def _greedy(so: SO | None = None, **kw) -> SamplingParams:
    if so is None:
        kw.setdefault("ignore_eos", True)
    return SamplingParams(temperature=0.0, max_tokens=kw.pop("max_tokens", 16),
                          structured_outputs=so, **kw)


# Constrained and unconstrained requests in the same steps; a repetitive free prompt (n-gram
# drafts), a seeded sampled constrained request, one asking for prompt logprobs (an eager
# step with prompt rows).
PROMPTS = ["a b a b a b a b", "JSON:", "Code:", "Pick:", "Sum:", "def main():", "Seeded:"]
PARAMS = [_greedy(max_tokens=14), _greedy(SO(json=SCHEMA), max_tokens=24),
          _greedy(SO(regex=REGEX), prompt_logprobs=1), _greedy(SO(choice=CHOICES)),
          _greedy(SO(grammar=GRAMMAR)), _greedy(max_tokens=10),
          SamplingParams(temperature=1.0, seed=7, max_tokens=16,
                         structured_outputs=SO(regex=REGEX))]
CHECKS = {1: lambda t: set(json.loads(t)) == {"a", "t"}, 2: lambda t: re.fullmatch(REGEX, t),
          3: lambda t: t in CHOICES, 4: lambda t: re.fullmatch(r"\([0-9](\+[0-9]){0,3}\)", t),
          6: lambda t: re.fullmatch(REGEX, t)}


def _engine(mode: str, **kw) -> LLM:
    extra = ({} if mode == "eager" else
             {"cuda_graph_mode": mode, "graph_tiers": "4,8,32", "max_num_batched_tokens": 32})
    return LLM("default", max_num_seqs=8, max_model_len=96, num_kv_blocks=64, **extra, **kw)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    """The batch's tokens from an eager engine that resolves every step before the next."""
    outs = _engine("eager", overlap_scheduling=False).generate(PROMPTS, PARAMS, use_tqdm=False)
    for i, check in CHECKS.items():
        assert outs[i].outputs[0].finish_reason == "stop", outs[i].outputs[0]
        assert check(outs[i].outputs[0].text), outs[i].outputs[0].text
    return _tokens(outs)


def _instrument(core, monkeypatch) -> list:
    """Log, in host order: each launch (its schedule, whether it samples a constrained
    request, the step in flight), every forward (the LM head), every real wait for a step's
    tokens, every mask fill, every step applied, every sampler launch (the tail), whether each
    launched step was kept in flight, and the scheduler's integrity after each step."""
    log: list = []
    model, structured = core.runner.model, core.structured
    compute, wait, prepare = model.compute_logits, core.wait, structured.prepare
    launch, due, tail_sample, apply = core.launch, core.due, whole.race_rows, core.apply
    step = core.step

    def logged_launch(out, **kw):
        log.append(("launch", structured.in_step(out), core.inflight))
        launched, errors = launch(out, **kw)
        log.append(("launched", launched))
        return launched, errors

    def checked_step():
        deltas = step()
        core.scheduler.check_integrity()
        return deltas

    def logged_wait(step):
        if step.sampled is None:
            log.append(("wait", step))
        return wait(step)

    def logged_due(launched, keep_in_flight):
        log.append(("kept", launched, keep_in_flight))
        return due(launched, keep_in_flight)

    monkeypatch.setattr(core, "launch", logged_launch)
    monkeypatch.setattr(core, "wait", logged_wait)
    monkeypatch.setattr(core, "due", logged_due)
    monkeypatch.setattr(core, "step", checked_step)
    monkeypatch.setattr(core, "apply", lambda st, sampled: (log.append(("apply", st)),
                                                            apply(st, sampled))[1])
    monkeypatch.setattr(structured, "prepare", lambda out, alongside=None: (
        log.append(("prepare",)), prepare(out, alongside))[1])
    monkeypatch.setattr(model, "compute_logits", lambda *a, **k: (log.append(("forward",)),
                                                                  compute(*a, **k))[1])
    monkeypatch.setattr(whole, "race_rows", lambda *a, **k: (log.append(("sample",)),
                                                             tail_sample(*a, **k))[1])
    return log


def _launches(log: list) -> list[tuple[bool, object, list, object]]:
    """Per launch: (samples a constrained request, step in flight, events inside, launched)."""
    out, i = [], 0
    while i < len(log):
        if log[i][0] == "launch":
            j = next(k for k in range(i, len(log)) if log[k][0] == "launched")
            out.append((log[i][1], log[i][2], log[i + 1: j], log[j][1]))
            i = j
        i += 1
    return out


def _first(events: list, kind: str, after: int = -1) -> int:
    return next(i for i, e in enumerate(events) if e[0] == kind and i > after)


@pytest.mark.parametrize("mode", MODES)
def test_forward_runs_before_the_wait_and_outputs_are_unchanged(mode, reference, monkeypatch):
    llm = _engine(mode, graph_check=3, poison_padding=True)
    core = llm.engine
    log = _instrument(core, monkeypatch)
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert _tokens(outs) == reference
    assert not core.has_unfinished() and core.block_manager.num_used_blocks == 0

    launches = _launches(log)
    split = [(inflight, ev) for constrained, inflight, ev, _ in launches if constrained]
    overlapped = [(inflight, ev) for inflight, ev in split if inflight is not None]
    assert len(overlapped) >= 5, launches
    for inflight, ev in overlapped:
        # The step's forward, then the wait for the step in flight (nothing else waited for),
        # then the mask fill, during which the step in flight is applied, then the tail's
        # sampler.
        forward, waited = _first(ev, "forward"), _first(ev, "wait")
        filled = _first(ev, "prepare")
        applied = _first(ev, "apply", filled)
        assert forward < waited < filled < applied < _first(ev, "sample", filled), ev
        assert [e[1] for e in ev if e[0] == "wait"] == [inflight]
        assert [e[1] for e in ev if e[0] == "apply"] == [inflight]
    for constrained, _, ev, _ in launches:
        if not constrained:  # nothing waits inside the launch of an unconstrained step
            assert not [e for e in ev if e[0] in ("wait", "prepare", "apply")], ev
    # Constrained steps stay in flight like any other.
    split_steps = {id(launched) for constrained, _, _, launched in launches if constrained}
    kept = [e[2] for e in log if e[0] == "kept" and id(e[1]) in split_steps]
    assert kept and all(kept)
    stats = llm.graph_stats()
    if mode != "eager":
        assert stats["hits"] and stats["checks"] > 0, stats
    runtime = core.runner.graphs
    if runtime.whole is not None:  # tail graphs replay for constrained steps only
        replays = {k: g.graph.replays for k, g in runtime.whole.tails.items()}
        assert sum(replays.values()) > 0 and set(stats["tail_nodes"]) == {
            f"{m}:{t}" for m, t in runtime.whole.tails}
        free = llm.generate(PROMPTS[:1], PARAMS[:1], use_tqdm=False)
        assert _tokens(free) == reference[:1]
        assert {k: g.graph.replays for k, g in runtime.whole.tails.items()} == replays


@pytest.mark.parametrize("mode, pipeline", [("eager", "off"), ("ragged", "off"),
                                            ("eager", "on"), ("ragged", "on")])
def test_verify_steps_with_constrained_rows(mode, pipeline, reference):
    """N-gram drafts for the free requests: verify steps carry constrained rows (one each,
    they never draft), and every output is the reference's. Pipelined, the constrained
    requests are never held: they decode in both cohorts' steps, each step's masks waiting
    for the other cohort's step in flight."""
    llm = _engine(mode, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                            "prompt_lookup_min": 1, "prompt_lookup_max": 2,
                                            "pipeline": pipeline})
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert _tokens(outs) == reference
    st = llm.spec_stats()
    assert st["draft_tokens"] > 0
    assert (st["pipelined_steps"] > 0) == (pipeline == "on")
    assert llm.engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("mode", ["eager", "ragged"])
def test_the_step_in_flight_is_applied_on_a_worker_while_the_masks_fill(mode, reference,
                                                                      monkeypatch):
    """Each fill beside a step in flight waits until a worker thread applies that step: an
    apply run before or after the fill, or on the engine thread, would leave it waiting (a
    timeout) or be counted as such."""
    llm = _engine(mode)
    core, structured = llm.engine, llm.engine.structured
    applying = threading.Event()
    fill, apply, prepare = structured._fill, core.apply, structured.prepare
    beside: list[bool] = []  # a step in flight is applied during this prepare
    overlapped: list[bool] = []

    def prepare_fresh(out, alongside=None):
        applying.clear()
        beside[:] = [alongside is not None]
        return prepare(out, alongside)

    def fill_meanwhile(matchers, slots):
        if matchers and beside[0]:
            overlapped.append(applying.wait(timeout=10))
        fill(matchers, slots)

    def applied(step, sampled):
        if threading.current_thread() is not threading.main_thread():
            applying.set()
        return apply(step, sampled)

    monkeypatch.setattr(structured, "apply_beside_rows", 1)  # every fill, however small
    monkeypatch.setattr(structured, "prepare", prepare_fresh)
    monkeypatch.setattr(structured, "_fill", fill_meanwhile)
    monkeypatch.setattr(core, "apply", applied)
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert _tokens(outs) == reference
    assert len(overlapped) >= 5 and all(overlapped), overlapped
    assert not core.has_unfinished() and core.block_manager.num_used_blocks == 0
