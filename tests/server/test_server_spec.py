"""``replaylm serve --speculative-config`` end to end: a real server process on loopback
answers with plain greedy decoding's text, and ``/metrics`` carries the spec counters."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx

from replaylm import LLM, SamplingParams
from tests.serve_process import serve_process

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
# Repeated spans (the n-gram drafter finds them) and one prompt without any.
PROMPTS = [[40 + i, 41, 42, 43] * 6 for i in range(4)] + [[7, 300, 51, 9, 1200, 77]]
MAX_TOKENS = 24


def _metrics(url: str) -> dict[str, float]:
    values = {}
    for line in httpx.get(url + "/metrics", trust_env=False).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def test_speculative_server_matches_plain_greedy(tmp_path):
    ref = LLM("default", device="cpu", num_kv_blocks=64, max_model_len=256)
    want = [o.outputs[0].text for o in ref.generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
        use_tqdm=False)]

    def complete(url: str, prompt: list[int], stream: bool = False) -> str:
        body = {"model": "default", "prompt": prompt, "max_tokens": MAX_TOKENS,
                "temperature": 0.0, "ignore_eos": True, "stream": stream}
        if not stream:
            r = httpx.post(url + "/v1/completions", json=body, timeout=120, trust_env=False)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]
        text = ""
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120,
                          trust_env=False) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text

    with serve_process(tmp_path / "serve.log", "--speculative-config", json.dumps(NGRAM),
                       "--num-kv-blocks", "64", "--max-model-len", "256") \
            as (_, url):
        with ThreadPoolExecutor(len(PROMPTS)) as pool:  # concurrent: verifies share steps
            got = list(pool.map(lambda p: complete(url, p), PROMPTS))
        assert got == want
        assert complete(url, PROMPTS[0], stream=True) == want[0]
        m = _metrics(url)
    assert m["replaylm_spec_verify_steps_total"] > 0
    assert m["replaylm_spec_draft_tokens_total"] >= m["replaylm_spec_accepted_tokens_total"] > 0
    assert 0 < m["replaylm_spec_acceptance_rate"] <= 1
    assert m["replaylm_spec_mean_accepted_length"] > 0
