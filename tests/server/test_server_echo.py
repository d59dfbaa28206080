"""``/v1/completions`` for evaluation harnesses: ``echo`` (prompt text and prompt logprobs in
the legacy format), ``max_tokens=0`` with ``echo`` (score the prompt alone), and prompts as
lists of token-id lists; streamed and whole, with no KV block left behind."""

from __future__ import annotations

import json

import httpx
import pytest

from replaylm.sampling_params import SamplingParams

PROMPT = "def fibonacci(n):"
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def http(live_server):
    with httpx.Client(base_url=live_server.url, timeout=60) as c:
        yield c


def _complete(http, **body) -> dict:
    r = http.post("/v1/completions", json={**GREEDY, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _prompt_reference(llm, prompt, k=2):
    """The offline engine's prompt logprobs of ``prompt`` (first entry None)."""
    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=k)
    out = llm.generate([prompt], sp, use_tqdm=False)[0]
    return out.prompt_token_ids, out.prompt_logprobs


def test_echo_prepends_prompt_text(live_server, http):
    plain = _complete(http, prompt=PROMPT, max_tokens=6)["choices"][0]
    echoed = _complete(http, prompt=PROMPT, max_tokens=6, echo=True)
    c = echoed["choices"][0]
    assert c["text"] == PROMPT + plain["text"]
    assert c["logprobs"] is None and c["finish_reason"] == "length"
    assert echoed["usage"]["completion_tokens"] == 6
    live_server.wait_idle()


def test_score_only_returns_prompt_logprobs(live_server, http, reference_llm):
    ids, ref = _prompt_reference(reference_llm, PROMPT)
    out = _complete(http, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2)
    c = out["choices"][0]
    assert c["text"] == PROMPT and c["finish_reason"] == "length"
    assert out["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0,
                            "total_tokens": len(ids)}
    lp = c["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) \
        == len(lp["text_offset"]) == len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    tok = reference_llm.get_tokenizer()
    assert lp["tokens"] == [tok.decode([t], skip_special_tokens=False) for t in ids]
    assert lp["text_offset"][0] == 0
    assert lp["text_offset"][1:] == [lp["text_offset"][i] + len(lp["tokens"][i])
                                     for i in range(len(ids) - 1)]
    for got, want, top in zip(lp["token_logprobs"][1:], ref[1:], lp["top_logprobs"][1:]):
        assert got == pytest.approx(want.logprob, abs=1e-5)
        assert len(top) <= 2 and max(top.values()) >= got - 1e-6
    live_server.wait_idle()


def test_echo_logprobs_are_prompt_then_completion(live_server, http):
    plain = _complete(http, prompt=PROMPT, max_tokens=4, logprobs=1)["choices"][0]
    c = _complete(http, prompt=PROMPT, max_tokens=4, logprobs=1, echo=True)["choices"][0]
    scored = _complete(http, prompt=PROMPT, max_tokens=0, logprobs=1, echo=True)["choices"][0]
    n = len(scored["logprobs"]["tokens"])
    lp = c["logprobs"]
    assert len(lp["tokens"]) == n + 4
    assert lp["tokens"][:n] == scored["logprobs"]["tokens"]
    assert lp["token_logprobs"][:n] == scored["logprobs"]["token_logprobs"]
    assert lp["tokens"][n:] == plain["logprobs"]["tokens"]
    assert lp["token_logprobs"][n:] == pytest.approx(plain["logprobs"]["token_logprobs"])
    # completion offsets point into the returned text, past the echoed prompt
    assert lp["text_offset"][n] == len(PROMPT)
    live_server.wait_idle()


def test_token_id_list_prompts(live_server, http, reference_llm):
    tok = reference_llm.get_tokenizer()
    prompts = [tok.encode(PROMPT), tok.encode("hello world")]
    out = _complete(http, prompt=prompts, max_tokens=0, echo=True, logprobs=1, n=2)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    for c in out["choices"]:
        ids = prompts[c["index"] // 2]
        assert c["text"] == tok.decode(ids, skip_special_tokens=False)
        lp = c["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) and lp["token_logprobs"][0] is None
        _, ref = _prompt_reference(reference_llm, ids, k=1)
        assert lp["token_logprobs"][1:] == pytest.approx([e.logprob for e in ref[1:]],
                                                         abs=1e-5)
    assert out["usage"]["prompt_tokens"] == len(prompts[0]) + len(prompts[1])
    assert out["usage"]["completion_tokens"] == 0
    # a list of strings, and a flat list of ids, are prompts too
    out = _complete(http, prompt=[PROMPT, "hello world"], max_tokens=2, echo=True)
    assert out["choices"][0]["text"].startswith(PROMPT)
    assert out["choices"][1]["text"].startswith("hello world")
    live_server.wait_idle()


def test_echo_streams_the_prompt_in_the_first_chunk(live_server, http):
    whole = _complete(http, prompt=PROMPT, max_tokens=5, logprobs=1, echo=True)["choices"][0]
    with http.stream("POST", "/v1/completions", json={
            **GREEDY, "prompt": PROMPT, "max_tokens": 5, "logprobs": 1, "echo": True,
            "stream": True}) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    texts = [e["choices"][0]["text"] for e in events]
    assert texts[0].startswith(PROMPT)
    assert "".join(texts) == whole["text"]
    tokens = [t for e in events if e["choices"][0]["logprobs"]
              for t in e["choices"][0]["logprobs"]["token_logprobs"]]
    assert tokens == whole["logprobs"]["token_logprobs"]
    assert events[-1]["choices"][0]["finish_reason"] == "length"

    with http.stream("POST", "/v1/completions", json={
            **GREEDY, "prompt": PROMPT, "max_tokens": 0, "echo": True, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert "".join(e["choices"][0]["text"] for e in events) == PROMPT
    live_server.wait_idle()


def test_max_tokens_zero_without_echo_is_400(live_server, http):
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    live_server.wait_idle()
