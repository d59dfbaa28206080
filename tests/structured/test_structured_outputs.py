"""Structured outputs on the built-in model (random weights, real BPE tokenizer), sampled at
temperature 1: every output of a JSON schema, json_object, a regex, a choice list and an EBNF
grammar parses and validates, eagerly and in ragged graphs (the CPU stand-in checks that the
mask buffers keep their addresses); unconstrained requests running beside them come out token
for token as they do alone; bad specs are ValueErrors naming the field and leak nothing."""

from __future__ import annotations

import json
import re

import pytest

from replaylm import LLM, SamplingParams
from replaylm.sampling_params import StructuredOutputsParams as SO

SCHEMA = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 9},
        "t": {"enum": ["x", "y"]},
        "l": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
              "maxItems": 2},
        "p": {"type": "object", "properties": {"b": {"type": "boolean"},
                                               "s": {"type": "string", "pattern": "^[a-z]{0,2}$"}},
              "required": ["b", "s"], "additionalProperties": False},
    },
    "required": ["a", "t", "l", "p"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,4}-[0-9]{1,2}"
CHOICES = ["red", "green", "blue"]
GRAMMAR = 'root ::= "(" [0-9] ("+" [0-9]){0,3} ")"'
KINDS = {"json": SO(json=SCHEMA), "json_object": SO(json_object=True), "regex": SO(regex=REGEX),
         "choice": SO(choice=CHOICES), "grammar": SO(grammar=GRAMMAR)}
MAX_TOKENS = {"json": 56, "json_object": 32, "regex": 12, "choice": 8, "grammar": 16}
# Random weights write long keys in a free JSON object: a bias towards '"' and '}' (tokens 5
# and 96 of the built-in tokenizer) closes them sooner, and one against '{}' (1920) keeps the
# objects from being all empty. It moves probabilities only; what may be written is still
# the grammar's.
BIAS = {"json_object": {5: 9.0, 96: 5.0, 1920: -100.0}}
FREE = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=12, ignore_eos=True)
        for i in range(3)]
FREE_PROMPTS = ["def main():", "import os", "class Foo:"]


def _validate_json(text: str) -> None:
    v = json.loads(text)
    assert isinstance(v, dict) and set(v) == {"a", "t", "l", "p"}, text
    assert isinstance(v["a"], int) and 0 <= v["a"] <= 9, text
    assert v["t"] in ("x", "y"), text
    assert isinstance(v["l"], list) and len(v["l"]) <= 2, text
    assert all(isinstance(x, int) and 0 <= x <= 9 for x in v["l"]), text
    assert set(v["p"]) == {"b", "s"} and isinstance(v["p"]["b"], bool), text
    assert isinstance(v["p"]["s"], str) and len(v["p"]["s"]) <= 2, text
    assert ": " in text and "\n" not in text, text  # xgrammar's fixed separators, no free space


def _validate_grammar(text: str) -> None:
    assert re.fullmatch(r"\([0-9](\+[0-9]){0,3}\)", text), text


CHECKS = {
    "json": _validate_json,
    "json_object": lambda t: isinstance(json.loads(t), dict) or pytest.fail(t),
    "regex": lambda t: re.fullmatch(REGEX, t) or pytest.fail(t),
    "choice": lambda t: t in CHOICES or pytest.fail(t),
    "grammar": _validate_grammar,
}


def _engine(mode: str | None) -> LLM:
    # Ragged: prefill chunks within the top tier, so every step replays a graph.
    extra = ({"cuda_graph_mode": mode, "graph_tiers": "8,16,64", "max_num_batched_tokens": 64}
             if mode else {})
    return LLM("default", max_num_seqs=64, max_model_len=128, num_kv_blocks=160, **extra)


@pytest.fixture(scope="module")
def eager():
    return _engine(None)


@pytest.fixture(scope="module")
def ragged():
    return _engine("ragged")


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("mode", ["eager", "ragged"])
def test_every_kind_parses_and_free_requests_are_untouched(mode, request):
    llm = request.getfixturevalue(mode)
    per_kind = 10 if mode == "eager" else 5  # ragged: the same code, fewer requests
    prompts, params, kinds = [], [], []
    for kind, so in KINDS.items():
        for seed in range(per_kind):
            prompts.append(f"Answer {kind} #{seed}:")
            params.append(SamplingParams(temperature=1.0, seed=seed, max_tokens=MAX_TOKENS[kind],
                                         logit_bias=BIAS.get(kind), structured_outputs=so))
            kinds.append(kind)
    # Unconstrained requests interleaved with the constrained ones, in the same steps.
    outs = llm.generate(FREE_PROMPTS + prompts, FREE + params, use_tqdm=False)
    for kind, out in zip(kinds, outs[len(FREE):]):
        o = out.outputs[0]
        assert o.finish_reason == "stop", (kind, o.text)
        CHECKS[kind](o.text)
    alone = llm.generate(FREE_PROMPTS, FREE, use_tqdm=False)
    assert _tokens(outs[: len(FREE)]) == _tokens(alone)
    core = llm.engine
    assert core.block_manager.num_used_blocks == 0
    if llm.graph_mode != "eager":
        stats = llm.graph_stats()
        assert stats["hits"] and not stats["fallbacks"], stats


BAD = [
    (SO(json='{"type": "object", "properties": {"a": {"type": "nope"}}}'), "structured_outputs.json"),
    (SO(json="{not json"), "structured_outputs.json"),
    (SO(regex="(("), "structured_outputs.regex"),
    (SO(grammar="root ::= "), "structured_outputs.grammar"),
]


def test_bad_specs_are_value_errors_naming_the_field(eager):
    llm = eager
    for so, field in BAD:
        with pytest.raises(ValueError, match=re.escape(field)):
            llm.generate(["x"], SamplingParams(structured_outputs=so), use_tqdm=False)
    with pytest.raises(ValueError, match=r"exactly one of .*\(got json and regex\)"):
        SO(json=SCHEMA, regex=REGEX)
    with pytest.raises(ValueError, match="structured_outputs.choice"):
        SO(choice=[])
    with pytest.raises(ValueError, match="exactly one"):
        SamplingParams(structured_outputs={"regex": "a", "choice": ["b"]})
    core = llm.engine
    args = core.args
    core.args = args.replace(structured_outputs_compile_timeout_s=1e-3)
    # A spec not compiled before that takes ~0.1 s to compile: over the (tiny) limit.
    slow = "(" + "|".join(f"w{i}x[a-z]{{1,5}}" for i in range(1500)) + ")"
    try:
        with pytest.raises(ValueError, match="structured_outputs.regex.*compile_timeout_s"):
            llm.generate(["x"], SamplingParams(structured_outputs=SO(regex=slow)),
                         use_tqdm=False)
    finally:
        core.args = args
    assert not core.has_unfinished() and core.block_manager.num_used_blocks == 0
    # The engine serves on: the same unconstrained requests, the same tokens.
    again = llm.generate(FREE_PROMPTS, FREE, use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "length" for o in again)
    assert core.block_manager.num_used_blocks == 0


def test_speculative_engine_drafts_for_free_requests_only():
    """With n-gram speculation, constrained requests never draft (one mask row per slot) and
    their outputs validate; a repetitive free request beside them still verifies drafts."""
    llm = LLM("default", max_num_seqs=8, max_model_len=128, num_kv_blocks=64,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                  "prompt_lookup_min": 1, "prompt_lookup_max": 2})
    kinds = ["regex", "choice", "grammar"]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=MAX_TOKENS[k],
                             structured_outputs=KINDS[k]) for k in kinds for s in range(2)]
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(["a b a b a b a b"] + ["Go:"] * len(params), [free] + params,
                        use_tqdm=False)
    for kind, out in zip([k for k in kinds for _ in range(2)], outs[1:]):
        assert out.outputs[0].finish_reason == "stop", (kind, out.outputs[0].text)
        CHECKS[kind](out.outputs[0].text)
    assert llm.spec_stats()["draft_tokens"] > 0  # the free request drafted
    assert llm.engine.block_manager.num_used_blocks == 0


def test_constrained_steps_overlap_with_current_grammar(eager, monkeypatch):
    """The overlap rule: steps that sample a constrained request stay in flight like any
    other, and every mask is filled after the grammar took every token sampled before it
    (those of the step in flight included), so the outputs still validate."""
    core = eager.engine
    structured = core.structured
    accepted: dict[str, int] = {}
    advance, prepare, launch = structured.advance, structured.prepare, core.launch
    ahead: list = []  # steps booked as launched (their samples pending) before their fill

    def counting_advance(out, sampled):
        for s in out.scheduled:
            if s.sample and s.request.grammar is not None and not s.request.is_finished:
                accepted[s.request.request_id] = accepted.get(s.request.request_id, 0) + 1
        return advance(out, sampled)

    def checking_prepare(out, alongside=None):
        for s in out.scheduled:
            req = s.request
            if s.sample and req.grammar is not None and not req.grammar.is_terminated():
                earlier = req.num_pending - any(out is b.out for b in ahead)
                assert accepted.get(req.request_id, 0) == req.num_output_tokens + earlier
        prepare(out, alongside)

    def noting_launch(out, apply_inflight=False, booked=None):
        if booked is not None:
            ahead.append(booked)
        return launch(out, apply_inflight, booked)

    monkeypatch.setattr(structured, "advance", counting_advance)
    monkeypatch.setattr(structured, "prepare", checking_prepare)
    monkeypatch.setattr(core, "launch", noting_launch)
    core.add_request("free", "hello", SamplingParams(temperature=0.0, max_tokens=4,
                                                     ignore_eos=True))
    core.step()
    core.step()
    assert core.inflight is not None  # overlapped
    core.add_request("so", "hello", SamplingParams(max_tokens=8, structured_outputs=SO(
        regex="[a-z]{6}")))
    kept, text, tokens = [], "", []
    while core.has_unfinished():
        for delta in core.step():
            if delta.request_id == "so":
                text += delta.new_text
                tokens += delta.new_token_ids
        kept.append(core.inflight is not None)
    assert any(kept), kept  # constrained steps were kept in flight
    assert re.fullmatch("[a-z]{6}", text), text
    assert accepted["so"] == len(tokens)  # every token it emitted, its stop token included
    assert core.block_manager.num_used_blocks == 0
    assert not core.structured.requests and not core.structured.busy


def test_json_whitespace_setting():
    """Compact JSON by default (xgrammar's any_whitespace=False); free whitespace on request."""
    import xgrammar

    from replaylm.config import EngineArgs
    from replaylm.engine.loading import load_model_config, load_tokenizer
    from replaylm.structured.compiler import compile_for

    cfg, model_dir = load_model_config("default")
    tok = load_tokenizer(EngineArgs(model="default"), model_dir)
    so = SO(json={"type": "object", "properties": {"a": {"type": "integer"}},
                  "required": ["a"]})
    for any_ws, spaced_ok in ((False, False), (True, True)):
        args = EngineArgs(model="default", structured_outputs_any_whitespace=any_ws)
        m = xgrammar.GrammarMatcher(compile_for(so, args, cfg, tok))
        assert m.accept_string('{"a": 1}') if not any_ws else True
        m = xgrammar.GrammarMatcher(compile_for(so, args, cfg, tok))
        assert m.accept_string('{  "a"  :\n 1 }') == spaced_ok


def test_advance_reports_each_refusal_and_notes_terminated_grammars(eager):
    """``advance`` on a step with requests of one token each, one whose token the grammar
    refuses, a verify request with two tokens, and one whose grammar already terminated: only
    the refusal is reported, each matcher holds what it accepted, and the terminated one is
    noted (``finished_by_grammar``)."""
    from types import SimpleNamespace as NS

    core = eager.engine
    tok, eos = core.tokenizer, core.model_config.eos_token_ids[0]
    digits = core.compile_structured(SamplingParams(structured_outputs=SO(regex="[0-9]+")))
    done = core.compile_structured(SamplingParams(structured_outputs=SO(choice=["ok"])))

    class Req:  # hashable, as requests are
        def __init__(self, grammar) -> None:
            self.grammar, self.is_finished = core._matcher(grammar), False

    def token(text: str) -> int:
        (t,) = tok.encode(text, add_special_tokens=False)
        return t

    a, b, c, d, e = Req(digits), Req(digits), Req(digits), Req(digits), Req(done)
    assert e.grammar.accept_string("ok") and e.grammar.accept_token(eos)
    assert e.grammar.is_terminated()
    scheduled = [NS(sample=True, drafts=[], request=a), NS(sample=True, drafts=[], request=b),
                 NS(sample=True, drafts=[0], request=c), NS(sample=True, drafts=[], request=d),
                 NS(sample=True, drafts=[], request=e)]
    sampled = [token("7"), token("x"), token("1"), token("2"), token("3"), token("4")]
    failed = core.structured.advance(NS(scheduled=scheduled), sampled)
    assert [r for r, _ in failed] == [b]
    assert "does not continue" in str(failed[0][1])
    assert a.grammar.accept_token(eos)  # "7" was taken
    assert not b.grammar.accept_token(eos)  # nothing was
    assert c.grammar.accept_string("9") and d.grammar.accept_token(eos)
    assert core.structured.finished_by_grammar(e) and not core.structured.finished_by_grammar(a)
