"""``POST /admin/update_weights`` while 50 streaming completions are in flight: no 500, every
stream either completes or ends with ``finish_reason="abort"`` and ``[DONE]`` (or is refused
with 503 while admission is paused), no KV block leaks, and the server answers with the new
weights afterwards, exactly as an engine given those weights offline does."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import torch
from safetensors.torch import save_file

from replaylm import LLM, SamplingParams
from replaylm.config import EngineArgs
from replaylm.engine.core import EngineCore
from replaylm.model.loader import to_hf_names
from tests.server.conftest import serve

KEY = "s3cret"
AUTH = {"Authorization": f"Bearer {KEY}"}
STREAMS = 50
ENGINE = dict(model="default", device="cpu", enforce_eager=True, max_num_seqs=8,
              max_model_len=256, num_kv_blocks=96)
PROMPT = "def fibonacci(n):"


def _weights_b(core: EngineCore, path) -> None:
    """A checkpoint of the default shape with other weights (B)."""
    g = torch.Generator().manual_seed(7)
    state = {n: (t.float() + torch.randn(t.shape, generator=g) * 0.05).to(t.dtype).contiguous()
             for n, t in to_hf_names(core.runner.model).items()}
    save_file(state, str(path / "model.safetensors"))


def _stream(url: str, i: int) -> tuple[int, list[dict], bool]:
    """One streaming completion: its status, its JSON events, whether it ended with [DONE]."""
    body = {"model": "default", "prompt": f"{PROMPT} # {i}", "max_tokens": 4 if i % 3 == 0 else 160,
            "temperature": 0.0, "ignore_eos": True, "stream": True}
    events, done = [], False
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, [], False
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
                continue
            events.append(json.loads(data))
    return 200, events, done


def test_update_weights_under_50_concurrent_streams(tmp_path):
    core = EngineCore(EngineArgs(**ENGINE))
    _weights_b(core, tmp_path)
    offline = LLM(**ENGINE)
    offline.update_weights(str(tmp_path))
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    text_b = offline.generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0].text
    body = {"model": "default", "prompt": PROMPT, "temperature": 0.0, "max_tokens": 12,
            "ignore_eos": True}

    with serve(core, max_queue=2 * STREAMS, admin_api_key=KEY,
               admin_drain_timeout=1.0) as server:
        url = server.url
        text_a = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        text_a = text_a["choices"][0]["text"]
        assert text_a != text_b, "B's weights must change the output"
        with ThreadPoolExecutor(STREAMS) as pool:
            # 40 streams first; the last 10 go out while the update drains the engine.
            futures = [pool.submit(_stream, url, i) for i in range(STREAMS - 10)]
            deadline = time.monotonic() + 30
            while server.engine.in_flight < 8 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert server.engine.in_flight >= 8, "the streams did not start"
            pending = pool.submit(httpx.post, url + "/admin/update_weights",
                                  json={"path": str(tmp_path)}, headers=AUTH, timeout=120)
            time.sleep(0.2)
            futures += [pool.submit(_stream, url, i) for i in range(STREAMS - 10, STREAMS)]
            update = pending.result(timeout=120)
            results = [f.result(timeout=180) for f in futures]
        assert update.status_code == 200, update.text
        assert update.json()["result"]["tensors"] > 0

        statuses = [s for s, _, _ in results]
        assert 500 not in statuses and set(statuses) <= {200, 503}, statuses
        ended = {"length": 0, "abort": 0}
        for status, events, done in results:
            if status != 200:
                continue
            assert done, "a stream ended without [DONE]"
            assert not any("error" in e for e in events), events
            reasons = [c["finish_reason"] for e in events for c in e.get("choices", [])
                       if c.get("finish_reason")]
            assert len(reasons) == 1 and reasons[0] in ended, reasons
            ended[reasons[0]] += 1
        # How many complete before the drain timeout depends on the machine's speed; each
        # one ended one way or the other, and the update aborted some.
        assert ended["abort"] > 0 and sum(ended.values()) == statuses.count(200), ended
        print(f"\n{STREAMS} streams: {ended['length']} completed, {ended['abort']} aborted, "
              f"{statuses.count(503)} refused with 503")

        server.wait_idle()
        after = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert after.status_code == 200, after.text
        assert after.json()["choices"][0]["text"] == text_b
        server.wait_idle()
        assert core.block_manager.num_used_blocks == 0, "KV blocks leaked"
        core.scheduler.check_integrity()
