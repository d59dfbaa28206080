"""The server in front of ``data_parallel_size=2`` worker processes (CPU, gloo)."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest

from replaylm import LLM, SamplingParams
from replaylm.config import EngineArgs
from replaylm.engine.llm import make_engine
from tests.server.conftest import serve

PROMPTS = [f"data parallel prompt {i}: " + "abc " * (i % 5) for i in range(10)]
SETTINGS = dict(model="default", device="cpu", enforce_eager=True, max_model_len=256,
                distributed_timeout_s=60.0)


@pytest.fixture(scope="module")
def dp_server():
    engine = make_engine(EngineArgs(data_parallel_size=2, **SETTINGS))
    try:
        with serve(engine, max_queue=64) as server:
            yield server
    finally:
        engine.shutdown()
    assert all(not p.is_alive() for p in engine.procs)


def test_completions_match_one_engine_while_metrics_are_scraped(dp_server):
    want = [o.outputs[0].text for o in LLM(**SETTINGS).generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        use_tqdm=False)]

    def complete(prompt: str) -> str:
        r = httpx.post(f"{dp_server.url}/v1/completions", timeout=60, json={
            "model": "default", "prompt": prompt, "max_tokens": 12, "temperature": 0.0,
            "ignore_eos": True})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    # Scrapes go to the workers from the HTTP thread while the engine thread steps them.
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        texts = pool.map(complete, PROMPTS)
        scrapes = [pool.submit(httpx.get, f"{dp_server.url}/metrics", timeout=60)
                   for _ in range(10)]
        assert list(texts) == want
        assert all(s.result().status_code == 200 for s in scrapes)
    metrics = httpx.get(f"{dp_server.url}/metrics", timeout=60).text

    def total(name: str) -> float:  # summed over labels
        return sum(float(line.split()[-1]) for line in metrics.splitlines()
                   if line.startswith(f"replaylm_{name}_total"))

    # Observed by the loop, and summed over the ranks at scrape time.
    assert total("requests_finished") == len(PROMPTS)
    assert total("requests_added") == len(PROMPTS)
    assert total("generation_tokens") == 12 * len(PROMPTS)
    # Both ranks served: every rank took part in every step and held requests.
    ranks = dp_server.call(lambda e: e.graph_stats()["ranks"], timeout=60)
    assert len(ranks) == 2 and ranks[0]["agreement_steps"] == ranks[1]["agreement_steps"] > 0
    stats = dp_server.call(lambda e: e.rank_stats(), timeout=60)
    assert all(s.requests_finished > 0 for s, _ in stats)


def test_a_bad_request_is_refused_by_the_driver(dp_server):
    r = httpx.post(f"{dp_server.url}/v1/completions", timeout=60, json={
        "model": "default", "prompt": list(range(3, 403)), "max_tokens": 4})
    assert r.status_code == 400 and "max_model_len" in r.text, r.text
    r = httpx.post(f"{dp_server.url}/v1/completions", timeout=60, json={
        "model": "default", "prompt": "still served", "max_tokens": 3})
    assert r.status_code == 200
