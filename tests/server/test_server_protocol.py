"""Request fields answered as OpenAI's API answers them: max_completion_tokens, non-finite and
out-of-range numbers, requests that can never be admitted, unknown models, routes, methods."""

from __future__ import annotations

import httpx
import pytest

CHAT = {"messages": [{"role": "user", "content": "Name a prime."}]}


def _post(url: str, endpoint: str, body: dict | bytes) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(f"{url}/v1/{endpoint}", content=body, timeout=60,
                          headers={"content-type": "application/json"})
    return httpx.post(f"{url}/v1/{endpoint}", json=body, timeout=60)


def _assert_400(r: httpx.Response, param: str) -> dict:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    return err


@pytest.mark.parametrize("body, param", [
    ({**CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({**CHAT, "max_completion_tokens": -1}, "max_completion_tokens"),
    ({**CHAT, "max_completion_tokens": 4, "max_tokens": -5}, "max_tokens"),
    ({**CHAT, "max_completion_tokens": 4, "max_tokens": 0}, "max_tokens"),
    ({**CHAT, "max_tokens": 0}, "max_tokens"),
])
def test_max_completion_tokens_is_checked_and_named(live_server, body, param):
    err = _assert_400(_post(live_server.url, "chat/completions", body), param)
    assert err["message"].startswith(param if param != "max_tokens" else "SamplingParams")


def test_max_completion_tokens_wins_over_max_tokens(live_server):
    r = _post(live_server.url, "chat/completions",
              {**CHAT, "max_completion_tokens": 3, "max_tokens": 50, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("raw, param", [
    (b'{"prompt": "hi", "temperature": Infinity}', "temperature"),
    (b'{"prompt": "hi", "temperature": 1e999}', "temperature"),
    (b'{"prompt": "hi", "temperature": NaN}', "temperature"),
    (b'{"prompt": "hi", "top_p": -Infinity}', "top_p"),
    (b'{"prompt": "hi", "logit_bias": {"5": 1e999}}', "logit_bias"),
    (b'{"prompt": "hi", "temperature": 3.5e38}', "temperature"),
    (b'{"prompt": "hi", "repetition_penalty": 3.5e38}', "repetition_penalty"),
    (b'{"prompt": "hi", "min_tokens": 9223372036854775808}', "min_tokens"),
    (b'{"prompt": "hi", "max_tokens": 9223372036854775808}', "max_tokens"),
    (b'{"prompt": "hi", "seed": 9223372036854775808}', "seed"),
    (b'{"prompt": "hi", "stop_token_ids": [9223372036854775808]}', "stop_token_ids"),
    ('{"prompt": "hi", "logit_bias": {"\u00b2": 1}}'.encode(), "logit_bias"),
])
def test_values_that_fit_json_but_not_the_engine_are_400(live_server, raw, param):
    err = _assert_400(_post(live_server.url, "completions", raw), param)
    assert "invalid literal" not in err["message"]  # our message, not int()'s


def test_huge_top_k_means_no_limit_and_tiny_temperature_is_greedy(live_server):
    base = {"prompt": "def f(x):", "max_tokens": 6, "ignore_eos": True}
    greedy = _post(live_server.url, "completions", {**base, "temperature": 0})
    tiny = _post(live_server.url, "completions", {**base, "temperature": 1e-40, "seed": 3})
    assert greedy.status_code == tiny.status_code == 200
    assert tiny.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]
    assert tiny.json()["usage"]["completion_tokens"] == 6
    free = _post(live_server.url, "completions", {**base, "temperature": 1.0, "seed": 5})
    top_k = _post(live_server.url, "completions",
                  {**base, "temperature": 1.0, "seed": 5, "top_k": 2**63})
    assert top_k.status_code == 200
    assert top_k.json()["choices"][0]["text"] == free.json()["choices"][0]["text"]


def test_request_that_can_never_be_admitted_is_400(live_server):
    engine = live_server.engine
    saved = engine.max_queue
    engine.max_queue = 3
    try:
        _assert_400(_post(live_server.url, "completions", {"prompt": "x", "n": 4}), "n")
        _assert_400(_post(live_server.url, "completions",
                          {"prompt": ["a", "b", "c", "d"]}), "prompt")
        _assert_400(_post(live_server.url, "completions",
                          {"prompt": ["a", "b"], "n": 2}), "prompt")
        _assert_400(_post(live_server.url, "chat/completions", {**CHAT, "n": 4}), "n")
        ok = _post(live_server.url, "completions", {"prompt": ["a", "b", "c"], "max_tokens": 2})
        assert ok.status_code == 200
    finally:
        engine.max_queue = saved


def test_unknown_model_is_404_model_not_found(live_server):
    r = _post(live_server.url, "completions", {"prompt": "hi", "model": "gpt-4"})
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and err["type"] == "invalid_request_error"
    assert err["param"] == "model" and "gpt-4" in err["message"]


def test_unknown_route_and_method_answer_openai_errors(live_server):
    r = httpx.post(live_server.url + "/v1/nothing", json={})
    assert r.status_code == 404
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert "/v1/nothing" in r.json()["error"]["message"]
    r = httpx.get(live_server.url + "/v1/completions")
    assert r.status_code == 405 and "POST" in r.headers["allow"]
    assert r.json()["error"]["type"] == "invalid_request_error"
