"""Many connections at once: batching, disconnects, invalid requests, back-pressure."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

MODEL = "default"
N_REQUESTS = 200


async def _stream(client: httpx.AsyncClient, body: dict, disconnect_after: int | None) -> dict:
    """Post a streaming completion; read it all, or drop the connection after a few events."""
    events: list[str] = []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return {"status": r.status_code, "body": r.json()}
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
                if disconnect_after is not None and len(events) >= disconnect_after:
                    return {"status": 200, "dropped": True}  # leaving the block closes it
    return {"status": 200, "events": events}


def _invalid(rng: random.Random) -> tuple[dict, str]:
    return rng.choice([
        ({"prompt": "x", "max_tokens": 0, "stream": True}, "max_tokens"),
        ({"prompt": "x", "temperature": -1, "stream": True}, "temperature"),
        ({"prompt": "x", "top_p": 2.0, "stream": True}, "top_p"),
        ({"prompt": "", "stream": True}, "prompt"),
        ({"prompt": [5] * 4000, "stream": True}, "prompt"),
        ({"prompt": "x", "n": "two", "stream": True}, "n"),
    ])


async def _load(url: str) -> list[tuple[str, dict, object, dict]]:
    rng = random.Random(7)
    limits = httpx.Limits(max_connections=N_REQUESTS + 10, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=120) as client:
        plan = []
        for i in range(N_REQUESTS):
            kind = "invalid" if i % 9 == 4 else "drop" if i % 5 == 2 else "ok"
            if kind == "invalid":
                body, expect = _invalid(rng)
                plan.append((kind, body, expect, None))
            else:
                body = {"model": MODEL, "prompt": f"request {i}: " + "word " * rng.randint(1, 20),
                        "max_tokens": rng.randint(4, 8) if kind == "ok" else 64,
                        "temperature": rng.choice([0.0, 0.8]), "seed": i, "ignore_eos": True,
                        "stream": True, "stream_options": {"include_usage": True}}
                plan.append((kind, body, body["max_tokens"], rng.randint(1, 2)))
        results = await asyncio.gather(*[
            _stream(client, body, after if kind == "drop" else None)
            for kind, body, _, after in plan
        ])
    return [(kind, body, expect, res) for (kind, body, expect, _), res in zip(plan, results)]


def test_concurrent_streams_with_disconnects_and_invalid(live_server):
    aborted_before = live_server.core.stats.requests_aborted
    outcomes = asyncio.run(_load(live_server.url))
    counts = {"ok": 0, "drop": 0, "invalid": 0}
    for kind, _body, expect, res in outcomes:
        counts[kind] += 1
        if kind == "invalid":
            assert res["status"] == 400, res
            assert res["body"]["error"]["param"] == expect, res
            continue
        assert res["status"] == 200, res
        if kind == "drop":
            continue
        events = res["events"]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert finish[-1] == "length" and all(f is None for f in finish[:-1])
        assert chunks[-1]["usage"]["completion_tokens"] == expect
    assert counts["ok"] > 100 and counts["drop"] > 20 and counts["invalid"] > 10
    live_server.wait_idle()  # every KV block back, integrity checked
    assert live_server.core.stats.requests_aborted > aborted_before
    assert httpx.get(live_server.url + "/health").json() == {"status": "ok"}


def test_backpressure_answers_503_with_retry_after(live_server):
    engine = live_server.engine
    saved = engine.max_queue
    engine.max_queue = 2
    long = {"model": MODEL, "prompt": "hold", "max_tokens": 1000, "ignore_eos": True,
            "stream": True}
    try:
        with httpx.Client(base_url=live_server.url, timeout=60) as a, \
                httpx.Client(base_url=live_server.url, timeout=60) as b:
            with a.stream("POST", "/v1/completions", json=long) as ra, \
                    b.stream("POST", "/v1/completions", json=long) as rb:
                # Keep the line iterators: a dropped one closes its response (a disconnect).
                lines_a, lines_b = ra.iter_lines(), rb.iter_lines()
                next(lines_a)
                next(lines_b)  # both admitted and streaming
                r = httpx.post(live_server.url + "/v1/completions",
                               json={"prompt": "one more", "max_tokens": 2})
                assert r.status_code == 503
                assert int(r.headers["Retry-After"]) >= 1
                assert r.json()["error"]["code"] == "overloaded"
                assert httpx.get(live_server.url + "/health").status_code == 200
                assert next(lines_a) is not None and next(lines_b) is not None  # still going
        live_server.wait_idle()  # the dropped streams were aborted, their blocks freed
        r = httpx.post(live_server.url + "/v1/completions",
                       json={"prompt": "one more", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200
    finally:
        engine.max_queue = saved


def test_non_streaming_disconnect_aborts(live_server):
    aborted = live_server.core.stats.requests_aborted
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(live_server.url + "/v1/completions", timeout=0.5,
                   json={"prompt": "a long answer", "max_tokens": 2000, "ignore_eos": True})
    live_server.wait_idle()
    assert live_server.core.stats.requests_aborted == aborted + 1
