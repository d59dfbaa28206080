"""Structured outputs through the HTTP API: OpenAI's ``response_format``, vLLM's
``structured_outputs`` extension and its older ``guided_*`` fields; bad specs are 400s
naming the field, and the engine serves on."""

from __future__ import annotations

import json
import re

import httpx
import pytest

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def http(live_server):
    with httpx.Client(base_url=live_server.url, timeout=60) as c:
        yield c


def _complete(http, **body):
    return http.post("/v1/completions", json={"prompt": "Answer:", "temperature": 1.0,
                                              "max_tokens": 24, **body})


def test_response_format_json_schema_and_guided_choice(live_server, http):
    rf = {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA, "strict": True}}
    for seed in range(3):
        r = http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "temperature": 1.0,
            "max_tokens": 24, "seed": seed, "response_format": rf})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        v = json.loads(choice["message"]["content"])
        assert set(v) == {"ok", "n"} and isinstance(v["ok"], bool) and 0 <= v["n"] <= 9
    r = _complete(http, seed=1, guided_choice=["yes", "no"], n=3)
    assert r.status_code == 200, r.text
    assert {c["text"] for c in r.json()["choices"]} <= {"yes", "no"}
    r = _complete(http, seed=2, structured_outputs={"regex": "[0-9]{2}"})
    assert r.status_code == 200 and re.fullmatch("[0-9]{2}", r.json()["choices"][0]["text"])
    r = _complete(http, seed=3, response_format={"type": "text"}, max_tokens=4)
    assert r.status_code == 200
    live_server.wait_idle()


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "r", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"guided_regex": "(("}, "guided_regex"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
])
def test_bad_specs_are_400_naming_the_field(live_server, http, body, param):
    r = _complete(http, **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert _complete(http, max_tokens=2).status_code == 200  # the engine serves on
    live_server.wait_idle()
