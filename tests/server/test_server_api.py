"""The OpenAI-compatible endpoints through the official ``openai`` client and raw HTTP."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from replaylm.sampling_params import SamplingParams
from replaylm.server.app import logprobs_supported
from replaylm.server.protocol import engine_supports

MODEL = "default"
PROMPT = "def fibonacci(n):"
GREEDY = {"temperature": 0.0, "max_tokens": 8}


@pytest.fixture(scope="module")
def client(live_server):
    c = openai.OpenAI(base_url=live_server.url + "/v1", api_key="unused", max_retries=0,
                      timeout=60)
    yield c
    c.close()


def _reference(llm, prompt, max_tokens=8, **kw):
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)
    return llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]


def _chat_ids(llm, messages):
    out = llm.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True,
                                                  tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_models_and_health(live_server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    r = httpx.get(live_server.url + "/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_completion_greedy_matches_llm_generate(client, reference_llm):
    ref = _reference(reference_llm, PROMPT)
    out = client.completions.create(model=MODEL, prompt=PROMPT, extra_body={"ignore_eos": True},
                                    **GREEDY)
    assert out.choices[0].text == ref.text
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == len(ref.token_ids) == 8
    n_prompt = len(reference_llm.get_tokenizer().encode(PROMPT))
    assert out.usage.prompt_tokens == n_prompt
    assert out.usage.total_tokens == n_prompt + 8

    chunks = list(client.completions.create(
        model=MODEL, prompt=PROMPT, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert all(c.usage is None for c in chunks[:-1])


def test_token_id_prompt(client, reference_llm):
    ids = reference_llm.get_tokenizer().encode(PROMPT)
    out = client.completions.create(model=MODEL, prompt=ids, extra_body={"ignore_eos": True},
                                    **GREEDY)
    assert out.choices[0].text == _reference(reference_llm, ids).text


def test_chat_greedy_matches_llm_generate(client, reference_llm):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name a prime."}]
    ref = _reference(reference_llm, _chat_ids(reference_llm, messages))
    out = client.chat.completions.create(model=MODEL, messages=messages,
                                         extra_body={"ignore_eos": True}, **GREEDY)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref.text
    assert out.usage.completion_tokens == 8
    assert out.usage.prompt_tokens == len(_chat_ids(reference_llm, messages))

    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    assert chunks[-1].usage.total_tokens == out.usage.total_tokens


@pytest.mark.parametrize("native", [True, False], ids=["engine-siblings", "server-fan-out"])
def test_n_and_seed(live_server, client, native):
    state = live_server.app.state
    if native and not state.native_n:
        pytest.skip("this engine build has no n > 1 (RequestDelta.index)")
    saved, state.native_n = state.native_n, native
    try:
        _check_n_and_seed(client)
    finally:
        state.native_n = saved


def _check_n_and_seed(client):
    kw = dict(model=MODEL, prompt=PROMPT, n=3, seed=1234, temperature=1.0, max_tokens=6,
              extra_body={"ignore_eos": True})
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert len({c.text for c in a.choices}) > 1  # siblings sample different streams
    assert a.usage.completion_tokens == 18
    chunks = list(client.completions.create(stream=True, **kw))
    texts = ["", "", ""]
    for c in chunks:
        texts[c.choices[0].index] += c.choices[0].text
    assert texts == [c.text for c in a.choices]


def test_stop_token_ids_and_top_k(client, reference_llm):
    ref = _reference(reference_llm, PROMPT)
    stop_at = ref.token_ids[3]
    first = ref.token_ids.index(stop_at)
    out = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0.0, max_tokens=8,
                                    extra_body={"stop_token_ids": [stop_at], "top_k": 5})
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens == first + 1


@pytest.mark.skipif(not engine_supports("stop"),
                    reason="this engine build has no stop strings (SamplingParams.stop)")
def test_stop_strings(client, reference_llm):
    ref = _reference(reference_llm, PROMPT).text
    stop = ref[len(ref) // 2: len(ref) // 2 + 2]
    out = client.completions.create(model=MODEL, prompt=PROMPT, stop=[stop],
                                    extra_body={"ignore_eos": True}, **GREEDY)
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == ref[: ref.index(stop)]


@pytest.mark.skipif(not logprobs_supported(),
                    reason="this engine build returns no logprobs (SamplingParams.logprobs and "
                    "RequestDelta.logprobs)")
def test_logprobs(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, logprobs=2,
                                    extra_body={"ignore_eos": True}, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert "".join(lp.tokens) == out.choices[0].text
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], logprobs=True,
        top_logprobs=3, extra_body={"ignore_eos": True}, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == 8 and all(len(t.top_logprobs) <= 3 for t in content)


BAD = [
    ("completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": -3}, "max_tokens"),
    ("completions", {"prompt": "hi", "temperature": -0.5}, "temperature"),
    ("completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("completions", {"prompt": "hi", "top_p": 1.5}, "top_p"),
    ("completions", {"prompt": "hi", "top_k": -7}, "top_k"),
    ("completions", {"prompt": "hi", "seed": -1}, "seed"),
    ("completions", {"prompt": "hi", "n": 0}, "n"),
    ("completions", {"prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"prompt": []}, "prompt"),
    ("completions", {"prompt": [10**9]}, "prompt"),
    ("completions", {"prompt": [5] * 5000}, "prompt"),
    ("completions", {"prompt": "x " * 5000}, "prompt"),
    ("completions", {"prompt": 5}, "prompt"),
    ("completions", {"max_tokens": 4}, "prompt"),
    ("completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
    ("completions", {"prompt": "hi", "max_tokens": "5"}, "max_tokens"),
    ("completions", {"prompt": "hi", "stream": "yes"}, "stream"),
    ("completions", {"prompt": "hi", "stream_options": 3}, "stream_options"),
    ("completions", {"prompt": "hi", "logprobs": 50}, "logprobs"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ("chat/completions", {"messages": "hello"}, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_p": -1},
     "top_p"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x " * 5000}]}, "messages"),
]


@pytest.mark.parametrize("endpoint,body,param", BAD,
                         ids=[f"{e}-{p}-{i}" for i, (e, _, p) in enumerate(BAD)])
def test_invalid_field_is_400_naming_it(live_server, endpoint, body, param):
    r = httpx.post(f"{live_server.url}/v1/{endpoint}", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    assert err["message"]


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[]", b"null", "{\"prompt\": \"\xff\"".encode()])
def test_malformed_body_is_400(live_server, raw):
    r = httpx.post(live_server.url + "/v1/completions", content=raw,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(live_server.url + "/health").status_code == 200


def test_metrics(live_server, client):
    client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=0.0)
    text = httpx.get(live_server.url + "/metrics").text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    for name in ("replaylm_prompt_tokens_total", "replaylm_generation_tokens_total",
                 "replaylm_time_to_first_token_seconds_count",
                 "replaylm_time_per_output_token_seconds_count", "replaylm_steps_total{mode=\"eager\"}"):
        assert values.get(name, 0) > 0, name
    assert sum(v for k, v in values.items()
               if k.startswith("replaylm_requests_finished_total")) > 0
    for name in ("replaylm_kv_cache_usage_ratio", "replaylm_num_requests_running",
                 "replaylm_num_requests_waiting", "replaylm_padding_tokens_total",
                 "replaylm_kv_blocks_total"):
        assert name in values, name
    assert any(k.startswith("replaylm_graph_mode{") for k in values)
    assert json.loads(httpx.get(live_server.url + "/health").text)["status"] == "ok"


@pytest.mark.skipif(not engine_supports("logit_bias"),
                    reason="this engine build has no logit_bias (SamplingParams.logit_bias)")
def test_logit_bias_and_penalties_reach_the_engine(client, reference_llm):
    target = reference_llm.get_tokenizer().encode("def", add_special_tokens=False)[0]
    out = client.completions.create(model=MODEL, prompt=PROMPT, logit_bias={str(target): 100},
                                    extra_body={"ignore_eos": True}, **GREEDY)
    assert out.choices[0].text == reference_llm.get_tokenizer().decode([target] * 8)
    out = client.completions.create(model=MODEL, prompt=PROMPT, presence_penalty=0.5,
                                    frequency_penalty=0.5, **GREEDY)
    assert out.choices[0].finish_reason in ("stop", "length")
