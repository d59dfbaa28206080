"""A hostile mix on loopback: 240 concurrent requests, streams that disconnect, and every
bad-input case at once. No 500s, no leaked KV blocks, every valid request completes, and the
valid streams carry exactly the text they would carry alone."""

from __future__ import annotations

import asyncio
import json
import random

import httpx

from replaylm.sampling_params import SamplingParams

N_REQUESTS = 240
BIG = 2**63
CHAT = [{"role": "user", "content": "hi"}]

# (path, body: dict or raw bytes, expected status, expected param)
BAD: list[tuple[str, dict | bytes, int, str | None]] = [
    ("completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("completions", {"prompt": "x", "temperature": 3.5e38}, 400, "temperature"),
    ("completions", {"prompt": "x", "repetition_penalty": 3.5e38}, 400, "repetition_penalty"),
    ("completions", {"prompt": "x", "min_tokens": BIG}, 400, "min_tokens"),
    ("completions", {"prompt": "x", "seed": BIG}, 400, "seed"),
    ("completions", {"prompt": "x", "top_p": 2.0}, 400, "top_p"),
    ("completions", {"prompt": "x", "top_k": -5}, 400, "top_k"),
    ("completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("completions", {"prompt": "x", "n": "two"}, 400, "n"),
    ("completions", {"prompt": "x", "logit_bias": {"\u00b2": 1}}, 400, "logit_bias"),
    ("completions", {"prompt": "x", "logit_bias": {"99999": 1}}, 400, "logit_bias"),
    ("completions", {"prompt": "x", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ("completions", {"prompt": "x", "stop": ["s"] * 33}, 400, "stop"),
    ("completions", {"prompt": "x", "stop": ["s" * 257]}, 400, "stop"),
    ("completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("completions", {"prompt": ""}, 400, "prompt"),
    ("completions", {"prompt": [10**9]}, 400, "prompt"),
    ("completions", {"prompt": [5] * 4000}, 400, "prompt"),
    ("completions", {"prompt": "x " * 5000}, 400, "prompt"),
    ("completions", {"prompt": "x", "model": "nope"}, 404, "model"),
    ("completions", b'{"prompt": "x", "temperature": Infinity}', 400, "temperature"),
    ("completions", b'{"prompt": "x", "temperature": 1e999}', 400, "temperature"),
    ("completions", b'{"prompt": "x", ', 400, None),
    ("completions", b"\xff\xfe", 400, None),
    ("completions", b"[]", 400, None),
    ("chat/completions", {"messages": CHAT, "max_completion_tokens": 0}, 400,
     "max_completion_tokens"),
    ("chat/completions", {"messages": CHAT, "max_completion_tokens": 3, "max_tokens": -1},
     400, "max_tokens"),
    ("chat/completions", {"messages": []}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ("chat/completions", {"messages": CHAT, "top_p": -1}, 400, "top_p"),
    ("nothing", {"prompt": "x"}, 404, None),
    ("completions", b'{"prompt": "' + b"x" * (9 * 2**20) + b'"}', 413, None),  # > 8 MiB
]


def _valid(i: int, rng: random.Random) -> dict:
    return {"prompt": f"request {i}: " + "word " * rng.randint(1, 20),
            "max_tokens": rng.randint(4, 8), "temperature": rng.choice([0.0, 0.8]),
            "seed": i, "ignore_eos": True, "top_k": rng.choice([-1, 20, BIG - 1])}


async def _stream(client: httpx.AsyncClient, body: dict, drop_after: int | None) -> dict:
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return {"status": r.status_code}
        events = []
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if drop_after is not None and len(events) >= drop_after:
                    return {"status": 200, "dropped": True}
    return {"status": 200, "events": events}


async def _bad(client: httpx.AsyncClient, path: str, body: dict | bytes) -> dict:
    if isinstance(body, bytes):
        r = await client.post(f"/v1/{path}", content=body,
                              headers={"content-type": "application/json"})
    else:
        r = await client.post(f"/v1/{path}", json=body)
    return {"status": r.status_code, "body": r.json()}


async def _load(url: str, plan: list[tuple]) -> list[dict]:
    limits = httpx.Limits(max_connections=N_REQUESTS + 10, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=120) as client:
        jobs = []
        for kind, payload in plan:
            if kind == "bad":
                jobs.append(_bad(client, payload[0], payload[1]))
            else:
                body = {**payload, "stream": True, "stream_options": {"include_usage": True}}
                jobs.append(_stream(client, body, 1 if kind == "drop" else None))
        return await asyncio.gather(*jobs)


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_hostile_mix(live_server, reference_llm):
    rng = random.Random(19)
    plan: list[tuple] = []
    bad = iter(BAD * 3)
    for i in range(N_REQUESTS):
        if i % 3 == 1:
            plan.append(("bad", next(bad, BAD[i % len(BAD)])))
        elif i % 10 in (2, 5, 8):
            plan.append(("drop", {**_valid(i, rng), "max_tokens": 200}))
        else:
            plan.append(("ok", _valid(i, rng)))
    errors_500 = _metric(live_server.url, 'replaylm_http_errors_total{status="500"}')
    results = asyncio.run(_load(live_server.url, plan))

    valid = [(body, res) for (kind, body), res in zip(plan, results) if kind == "ok"]
    params = [SamplingParams(**{k: v for k, v in body.items() if k != "prompt"})
              for body, _ in valid]
    refs = reference_llm.generate([body["prompt"] for body, _ in valid], params, use_tqdm=False)
    for (body, res), ref in zip(valid, refs):
        assert res["status"] == 200 and res["events"][-1] == "[DONE]", res
        chunks = [json.loads(e) for e in res["events"][:-1]]
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        assert text == ref.outputs[0].text, body
        assert chunks[-1]["usage"]["completion_tokens"] == body["max_tokens"]
    for (kind, payload), res in zip(plan, results):
        assert res["status"] != 500, (payload, res)
        if kind == "bad":
            path, _, status, param = payload
            assert res["status"] == status, (payload, res)
            assert set(res["body"]["error"]) == {"message", "type", "param", "code"}
            if param is not None:
                assert res["body"]["error"]["param"] == param, (payload, res)
        elif kind == "drop":
            assert res["status"] == 200
    counts = {k: sum(1 for kind, _ in plan if kind == k) for k in ("ok", "drop", "bad")}
    assert counts["bad"] >= 3 * len(BAD) - 20 and counts["ok"] > 80 and counts["drop"] > 40
    live_server.wait_idle()  # every KV block back, integrity checked
    assert _metric(live_server.url, 'replaylm_http_errors_total{status="500"}') == errors_500
    assert httpx.get(live_server.url + "/health").json() == {"status": "ok"}
