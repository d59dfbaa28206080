"""Structured outputs under tensor and data parallelism on CPU (worker processes over gloo).

The built-in model (random weights, real BPE tokenizer) writes JSON-schema, regex, choice,
grammar and forced tool-call outputs, greedy and seeded, beside unconstrained requests with
penalties. With ``tensor_parallel_size=2`` the leader alone holds the grammars and masks and
broadcasts its tokens while a mask is on, so a follower whose tokens differed would embed
other inputs and the group's outputs would leave those of one engine: every output equals
the single engine's token for token and validates. Under ``data_parallel_size=2`` each rank's
engine serves its own requests with its own grammars. A bad schema is a ``ValueError``
naming the field, and the requests already running finish as they would have.
"""

from __future__ import annotations

import json
import re

import pytest

from replaylm import LLM, SamplingParams
from replaylm.sampling_params import StructuredOutputsParams as SO
from replaylm.server.tool_calls import parse, tool_grammar
from tests.structured.test_structured_outputs import CHECKS, KINDS, MAX_TOKENS

TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}]
TOOL = SO(structural_tag=tool_grammar(TOOLS, "hermes", parallel=False))


def _check_tool(text: str) -> None:
    parsed = parse("hermes", text, {"weather"})
    assert parsed.content is None and len(parsed.calls) == 1, text
    args = json.loads(parsed.calls[0].arguments)
    assert args["city"] in ("Paris", "Rome") and 1 <= args["days"] <= 7, text


SPECS = {k: KINDS[k] for k in ("json", "regex", "choice", "grammar")} | {"tool": TOOL}
LIMITS = MAX_TOKENS | {"tool": 96}
VALID = CHECKS | {"tool": _check_tool}


def _requests() -> tuple[list[str], list[SamplingParams], list[str | None]]:
    """Each kind greedy and seeded (temperature 1), between unconstrained requests whose
    penalties count every sampled token."""
    prompts, params, kinds = [], [], []
    for i, (kind, so) in enumerate(SPECS.items()):
        for temperature in (0.0, 1.0):
            prompts.append(f"Answer {kind} #{i}:")
            params.append(SamplingParams(temperature=temperature, seed=i, max_tokens=LIMITS[kind],
                                         structured_outputs=so))
            kinds.append(kind)
        prompts.append(f"free text {i}")
        params.append(SamplingParams(temperature=1.0, seed=50 + i, max_tokens=10, ignore_eos=True,
                                     presence_penalty=1.5, repetition_penalty=1.2))
        kinds.append(None)
    return prompts, params, kinds


PROMPTS, PARAMS, KIND_OF = _requests()


def _kw(mode: str) -> dict:
    kw = dict(max_num_seqs=16, max_model_len=128, num_kv_blocks=80, max_num_batched_tokens=64,
              distributed_timeout_s=120.0)
    if mode == "eager":
        return kw | dict(enforce_eager=True)
    return kw | dict(cuda_graph_mode=mode, graph_tiers="8,16,64", graph_check=1)


def _run(llm: LLM) -> list[list[int]]:
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    for kind, out in zip(KIND_OF, outs):
        o = out.outputs[0]
        if kind is None:
            assert o.finish_reason == "length", o
            continue
        assert o.finish_reason == "stop", (kind, o.text)
        VALID[kind](o.text)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def one_engine() -> list[list[int]]:
    """The tokens of one engine (on CPU every graph mode gives the same)."""
    return _run(LLM("default", **_kw("eager")))


def _bad_schema_loses_nothing(llm: LLM, want: list[list[int]]) -> None:
    """A bad schema among running requests: a ValueError naming the field; the requests
    queued before it finish with their tokens, and the engine serves on."""
    engine = llm.engine
    keep = [i for i, k in enumerate(KIND_OF) if k in ("regex", "tool", None)][:4]
    for i in keep:
        engine.add_request(f"keep{i}", PROMPTS[i], PARAMS[i])
    engine.step()
    bad = SO(json='{"type": "object", "properties": {"a": {"type": "nope"}}}')
    with pytest.raises(ValueError, match=re.escape("structured_outputs.json")):
        engine.add_request("bad", "x", SamplingParams(structured_outputs=bad))
    with pytest.raises(ValueError, match=re.escape("prompt 1: ")):  # nothing of it queued
        llm.generate(["a", "b"], [PARAMS[0], SamplingParams(structured_outputs=bad)],
                     use_tqdm=False)
    got: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for d in engine.step():
            got.setdefault(d.request_id, []).extend(d.new_token_ids)
    assert got == {f"keep{i}": want[i] for i in keep}
    assert _run(llm) == want


@pytest.mark.parametrize("mode", ["ragged", "eager"])
def test_tp2_matches_one_engine(one_engine, mode):
    with LLM("default", tensor_parallel_size=2, **_kw(mode)) as llm:
        assert _run(llm) == one_engine
        if mode == "ragged":
            stats = llm.graph_stats()
            assert stats["hits"] and not stats["fallbacks"], stats
        else:
            _bad_schema_loses_nothing(llm, one_engine)


def test_dp2_matches_one_engine(one_engine):
    with LLM("default", data_parallel_size=2, **_kw("ragged")) as llm:
        assert _run(llm) == one_engine
        finished = [s.requests_finished for s, _ in llm.engine.rank_stats()]
        assert all(finished) and sum(finished) == len(PROMPTS), finished  # both ranks served
        _bad_schema_loses_nothing(llm, one_engine)


def test_dp2_tp2_matches_one_engine(one_engine):
    with LLM("default", data_parallel_size=2, tensor_parallel_size=2, **_kw("eager")) as llm:
        assert _run(llm) == one_engine
