"""The tool-call parsers on hand-written model outputs, their streaming, and the request checks
of ``tools`` / ``tool_choice`` (no engine needed)."""

from __future__ import annotations

import json

import pytest

from replaylm.server.protocol import APIError, ChatCompletionRequest
from replaylm.server.tool_calls import ToolCallStream, parse, tool_grammar
from replaylm.server.tool_plan import tool_plan

NAMES = {"get_weather", "search"}


def _calls(parsed):
    return [(c.name, json.loads(c.arguments)) for c in parsed.calls]


def test_hermes_parser():
    out = parse("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
                '{"city": "Oslo"}}\n</tool_call>\n<tool_call>\n{"name": "search", "arguments": '
                '{"q": "x"}}\n</tool_call>', NAMES)
    assert out.content == "Let me check."
    assert _calls(out) == [("get_weather", {"city": "Oslo"}), ("search", {"q": "x"})]
    assert all(c.id.startswith("call_") for c in out.calls)
    # the last block may lack its end (the output stopped at EOS)
    out = parse("hermes", '<tool_call>{"name": "search", "arguments": {}}', NAMES)
    assert out.content is None and _calls(out) == [("search", {})]
    # arguments sent as a JSON string are read too
    out = parse("hermes", '<tool_call>{"name": "search", "arguments": "{\\"q\\": 1}"}'
                '</tool_call>', NAMES)
    assert _calls(out) == [("search", {"q": 1})]


@pytest.mark.parametrize("text", [
    "just text, no call",
    '<tool_call>{"name": "search", "arguments": {broken</tool_call>',
    '<tool_call>{"name": "unknown_fn", "arguments": {}}</tool_call>',
    '<tool_call>["not", "an", "object"]</tool_call>',
    "",
])
def test_hermes_not_a_call_is_content(text):
    out = parse("hermes", text, NAMES)
    assert out.calls == [] and out.content == (text or None)


def test_llama3_json_parser():
    out = parse("llama3_json", '{"name": "get_weather", "parameters": {"city": "Rome"}}; '
                '{"name": "search", "parameters": {"q": "y"}}', NAMES)
    assert out.content is None
    assert _calls(out) == [("get_weather", {"city": "Rome"}), ("search", {"q": "y"})]
    out = parse("llama3_json", '<|python_tag|>{"name": "search", "arguments": {"q": 2}}', NAMES)
    assert _calls(out) == [("search", {"q": 2})]
    for text in ('The weather is {"name": "search"}', '{"name": "search", "parameters": {}} and',
                 '{"name": "nope", "parameters": {}}', '{"a": 1'):
        out = parse("llama3_json", text, NAMES)
        assert out.calls == [] and out.content == text, text


def _stream(parser, pieces):
    s = ToolCallStream(parser, NAMES)
    content, deltas = "", []
    for i, piece in enumerate(pieces):
        c, d = s.push(piece, i == len(pieces) - 1)
        content += c
        deltas.append(d)
    return content, deltas


def test_stream_sends_calls_when_complete_and_content_as_it_comes():
    text = ('Sure. <tool_call>\n{"name": "search", "arguments": {"q": "a"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "b"}}\n</tool_call>')
    pieces = [text[i:i + 5] for i in range(0, len(text), 5)]
    content, deltas = _stream("hermes", pieces)
    assert content == "Sure. "
    got = [(i, d) for i, ds in enumerate(deltas) for d in ds]
    assert [d["index"] for _, d in got] == [0, 1]
    assert [d["function"]["name"] for _, d in got] == ["search", "get_weather"]
    assert got[0][0] < len(pieces) - 1  # the first call went out before the end
    assert all(d["type"] == "function" and d["id"].startswith("call_") for _, d in got)
    assert json.loads(got[1][1]["function"]["arguments"]) == {"city": "b"}
    # the marker arriving in pieces is held back, then released when it is no marker
    content, deltas = _stream("hermes", ["a <tool", "_cal", "x> b"])
    assert content == "a <tool_calx> b" and not any(deltas)
    # llama3_json: plain text streams; a JSON call goes out at the end
    content, deltas = _stream("llama3_json", ["Hello", " there"])
    assert content == "Hello there" and not any(deltas)
    content, deltas = _stream("llama3_json", ['{"name": "search", ', '"parameters": {}}'])
    assert content == "" and [d["function"]["name"] for d in deltas[-1]] == ["search"]


def test_tool_grammar_shapes():
    tools = [{"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}}}}]
    tag = tool_grammar(tools, "hermes", parallel=False)
    fmt = tag["format"]
    assert fmt["type"] == "tags_with_separator" and fmt["at_least_one"]
    assert fmt["stop_after_first"]
    assert fmt["tags"][0]["begin"] == '<tool_call>\n{"name": "search", "arguments": '
    assert fmt["tags"][0]["end"] == "}\n</tool_call>"
    tag = tool_grammar(tools, "llama3_json", parallel=True)
    assert tag["format"]["separator"] == "; " and not tag["format"]["stop_after_first"]
    assert tag["format"]["tags"][0]["begin"] == '{"name": "search", "parameters": '


TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("extra, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "auto"}, "tool_choice"),  # no parser configured
    ({"tools": TOOLS * 2, "tool_choice": "required"}, "tools"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_tool_requests_name_the_field(extra, param):
    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, **extra})
    with pytest.raises(APIError) as e:
        tool_plan(body, None)
    assert e.value.param == param and e.value.status == 400


def test_tool_plans():
    def plan(parser, **extra):
        return tool_plan(ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "hi"}], **extra}), parser)

    assert plan(None).parser is None  # no tools
    assert plan("hermes", tools=TOOLS, tool_choice="none").parser is None
    auto = plan("hermes", tools=TOOLS)  # tools given: "auto" by default
    assert auto.parser == "hermes" and auto.constraint is None
    forced = plan(None, tools=TOOLS, tool_choice="required")
    assert forced.parser == "hermes" and forced.constraint.kind == "structural_tag"
    named = plan("llama3_json", tools=TOOLS,
                 tool_choice={"type": "function", "function": {"name": "search"}})
    assert named.constraint.structural_tag["format"]["stop_after_first"]
