"""Tool calls through ``/v1/chat/completions`` on the built-in random-weights model: with
``tool_choice="required"`` or a named function the grammar is what makes every call parse
and validate against its schema; ``"auto"`` returns what the model wrote; streaming follows
OpenAI's ``tool_calls`` deltas; the chat template renders the tools."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from replaylm.config import EngineArgs
from replaylm.engine.core import EngineCore
from replaylm.sampling_params import SamplingParams, StructuredOutputsParams
from replaylm.server.tool_calls import parse, tool_grammar
from tests.server.conftest import serve

# A minimal template that renders tools, earlier calls and tool results (hermes style).
TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|im_start|>system\nFunctions:\n{% for t in tools %}"
    "{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}{% for m in messages %}"
    "<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>\n"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n</tool_call>"
    "{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 10},
    "unit": {"enum": ["c", "f"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit"], "additionalProperties": False}
BOOK = {"type": "object", "properties": {
    "people": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    "when": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
    "where": {"type": "object", "properties": {"table": {"type": "integer", "minimum": 1,
                                                         "maximum": 40}},
              "required": ["table"], "additionalProperties": False}},
    "required": ["people", "when", "where"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather",
                                            "parameters": WEATHER}},
         {"type": "function", "function": {"name": "book_table", "parameters": BOOK}}]
SCHEMAS = {"get_weather": WEATHER, "book_table": BOOK}
MESSAGES = [{"role": "user", "content": "What is the weather in Oslo?"}]
SAMPLED = {"temperature": 1.0, "max_tokens": 400}


@pytest.fixture(scope="module")
def tool_server():
    core = EngineCore(EngineArgs(model="default", device="cpu"))
    core.tokenizer.chat_template = TEMPLATE
    with serve(core, tool_call_parser="hermes") as server:
        yield server


@pytest.fixture(scope="module")
def client(tool_server):
    c = openai.OpenAI(base_url=tool_server.url + "/v1", api_key="unused", max_retries=0,
                      timeout=120)
    yield c
    c.close()


def _check_calls(calls, names=SCHEMAS):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_calls_validate(tool_server, client):
    out = client.chat.completions.create(model="default", messages=MESSAGES, tools=TOOLS,
                                         tool_choice="required", n=6, seed=0, **SAMPLED)
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None
        _check_calls(choice.message.tool_calls)
    single = client.chat.completions.create(
        model="default", messages=MESSAGES, tools=TOOLS, tool_choice="required", n=4, seed=1,
        parallel_tool_calls=False, **SAMPLED)
    for choice in single.choices:
        assert len(choice.message.tool_calls) == 1
        _check_calls(choice.message.tool_calls)
    tool_server.wait_idle()


def test_named_function_calls_validate(tool_server, client):
    out = client.chat.completions.create(
        model="default", messages=MESSAGES, tools=TOOLS, n=6, seed=2,
        tool_choice={"type": "function", "function": {"name": "book_table"}}, **SAMPLED)
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls"
        assert [c.function.name for c in choice.message.tool_calls] == ["book_table"]
        _check_calls(choice.message.tool_calls)
    tool_server.wait_idle()


def test_required_calls_stream_as_openai_deltas(tool_server, client):
    stream = client.chat.completions.create(
        model="default", messages=MESSAGES, tools=TOOLS, tool_choice="required", seed=3,
        stream=True, **SAMPLED)
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and content == ""
    assert sorted(calls) == list(range(len(calls))) and calls
    for entry in calls.values():
        assert entry["id"].startswith("call_")
        jsonschema.validate(json.loads(entry["arguments"]), SCHEMAS[entry["name"]])
    tool_server.wait_idle()


def test_auto_returns_plain_content_when_no_call(tool_server, client):
    out = client.chat.completions.create(model="default", messages=MESSAGES, tools=TOOLS,
                                         seed=4, temperature=1.0, max_tokens=12)
    choice = out.choices[0]
    # a random model writes no <tool_call> block: the output is content, as the parser says
    assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")
    assert parse("hermes", choice.message.content or "", set(SCHEMAS)).calls == []
    tool_server.wait_idle()


def test_template_renders_tools_and_history(tool_server):
    def prompt_tokens(**body):
        r = httpx.post(tool_server.url + "/v1/chat/completions", timeout=60, json={
            "messages": MESSAGES, "max_tokens": 1, "tool_choice": "none", **body})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    bare = httpx.post(tool_server.url + "/v1/chat/completions", timeout=60, json={
        "messages": MESSAGES, "max_tokens": 1}).json()["usage"]["prompt_tokens"]
    assert prompt_tokens(tools=TOOLS) > bare + 50
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12 C"}]
    assert prompt_tokens(tools=TOOLS, messages=history) > prompt_tokens(tools=TOOLS)
    tool_server.wait_idle()


@pytest.mark.parametrize("body, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "nope"}}}}}],
      "tool_choice": "required"}, "tools"),
])
def test_bad_tool_requests_are_400(tool_server, body, param):
    r = httpx.post(tool_server.url + "/v1/chat/completions", timeout=60,
                   json={"messages": MESSAGES, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    tool_server.wait_idle()


def test_llama3_json_calls_through_the_engine(reference_llm):
    """The llama3_json format's grammar on the offline engine: parallel calls separated by
    '; ' that its parser reads back and that validate."""
    tag = tool_grammar(TOOLS, "llama3_json", parallel=True)
    sp = SamplingParams(temperature=1.0, max_tokens=400, seed=5, n=4,
                        structured_outputs=StructuredOutputsParams(structural_tag=tag))
    for out in reference_llm.generate(["Call a function:"], sp, use_tqdm=False)[0].outputs:
        parsed = parse("llama3_json", out.text, set(SCHEMAS))
        assert parsed.content is None and parsed.calls, out.text
        for call in parsed.calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
