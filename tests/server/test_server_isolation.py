"""One request's failure is its own: other streams go on token for token. An engine fault
fails everyone and turns /health to 503 for good (own server: it ends unhealthy)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from replaylm.config import EngineArgs
from replaylm.engine.core import EngineCore
from replaylm.sampling_params import SamplingParams
from tests.server.conftest import serve

PROMPTS = ["def main():", "import os", "class Foo:"]
VICTIM_SEED = 666


@pytest.fixture(scope="module")
def server():
    with serve(EngineCore(EngineArgs(model="default", device="cpu")), max_queue=64) as s:
        yield s


async def _stream(client: httpx.AsyncClient, body: dict) -> dict:
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return {"status": r.status_code, "body": r.json()}
        events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
    return {"status": 200, "events": events}


async def _mixed(url: str) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        good = [{"prompt": p, "max_tokens": 12, "temperature": 0.8, "seed": i,
                 "ignore_eos": True, "stream": True} for i, p in enumerate(PROMPTS)]
        victim = {"prompt": "while True:", "max_tokens": 12, "temperature": 0.8,
                  "seed": VICTIM_SEED, "ignore_eos": True}
        tasks = [_stream(client, b) for b in good]
        tasks.append(_stream(client, {**victim, "stream": True}))
        tasks.append(client.post("/v1/completions", json=victim))
        return await asyncio.gather(*tasks)


def test_one_failing_request_leaves_the_others_intact(server, reference_llm, monkeypatch):
    state = server.core.runner.sampler.state
    real_set = state.set

    def set_(slot, params, seed):  # runs on the engine thread, inside step()
        if params.seed == VICTIM_SEED:
            raise RuntimeError("injected slot fault")
        return real_set(slot, params, seed)

    monkeypatch.setattr(state, "set", set_)
    *good, victim_stream, victim_plain = asyncio.run(_mixed(server.url))
    for i, (prompt, res) in enumerate(zip(PROMPTS, good)):
        sp = SamplingParams(temperature=0.8, seed=i, max_tokens=12, ignore_eos=True)
        ref = reference_llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0].text
        assert res["status"] == 200 and res["events"][-1] == "[DONE]", res
        chunks = [json.loads(e) for e in res["events"][:-1]]
        assert "".join(c["choices"][0]["text"] for c in chunks) == ref
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert victim_stream["events"][-1] == "[DONE]"
    err = json.loads(victim_stream["events"][-2])["error"]
    assert err["type"] == "server_error" and "injected slot fault" in err["message"]
    assert victim_plain.status_code == 500
    assert "injected slot fault" in victim_plain.json()["error"]["message"]
    server.wait_idle()
    assert httpx.get(server.url + "/health").status_code == 200
    metrics = httpx.get(server.url + "/metrics").text
    assert 'replaylm_requests_finished_total{finish_reason="error"} 2.0' in metrics


def test_engine_fault_fails_everyone_and_health_turns_503(server, monkeypatch):
    def broken_step():
        raise RuntimeError("injected engine fault")

    monkeypatch.setattr(server.core, "step", broken_step)
    r = httpx.post(server.url + "/v1/completions", timeout=30,
                   json={"prompt": "doomed", "max_tokens": 4})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert "injected engine fault" in r.json()["error"]["message"]
    health = httpx.get(server.url + "/health")
    assert health.status_code == 503 and health.json()["status"] == "unavailable"
    r = httpx.post(server.url + "/v1/completions", timeout=30,
                   json={"prompt": "after", "max_tokens": 4})
    assert r.status_code == 503 and "engine failed" in r.json()["error"]["message"]
