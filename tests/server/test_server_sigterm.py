"""``replaylm serve`` as a real process: SIGTERM drains in-flight work and exits 0."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from tests.serve_process import serve_process


def _read_stream(url: str, body: dict, first: threading.Event, out: dict) -> None:
    events = []
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    first.set()
    except httpx.HTTPError as e:  # a cut connection: the test fails on it below
        out["error"] = repr(e)
    finally:
        out["events"] = events
        first.set()


def _post(url: str, body: dict, out: dict) -> None:
    try:
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        out["status"], out["body"] = r.status_code, r.json()
    except (httpx.HTTPError, ValueError) as e:
        out["error"] = repr(e)


def test_sigterm_drains_then_cancels_cleanly_and_exits_zero(tmp_path):
    """SIGTERM: stop accepting; a request that finishes within --shutdown-timeout finishes;
    past it, every stream gets an error event and [DONE] and every plain request a 503 JSON;
    no traceback in the log; exit status 0."""
    log = tmp_path / "serve.log"
    with serve_process(log, "--shutdown-timeout", "2", "--log-level", "info") as (proc, url):
        # A short stream that finishes while draining, and requests far too long for the
        # timeout: two streams and two plain ones (max_model_len is 2048).
        short = {"prompt": "short", "max_tokens": 40, "ignore_eos": True, "stream": True}
        endless = {"prompt": "endless", "max_tokens": 2040, "ignore_eos": True}
        streams = [short, {**endless, "stream": True}, {**endless, "stream": True}]
        results: list[dict] = [{} for _ in streams]
        firsts = [threading.Event() for _ in streams]
        threads = [threading.Thread(target=_read_stream, args=(url, b, f, r), daemon=True)
                   for b, f, r in zip(streams, firsts, results)]
        plain: list[dict] = [{}, {}]
        threads += [threading.Thread(target=_post, args=(url, endless, r), daemon=True)
                    for r in plain]
        for t in threads:
            t.start()
        assert all(f.wait(60) for f in firsts)
        time.sleep(0.5)  # the plain requests are in too
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(httpx.HTTPError):  # no longer accepting connections
            httpx.get(url + "/health", timeout=2)
        assert proc.wait(timeout=60) == 0, log.read_text()
        for t in threads:
            t.join(10)
    text = log.read_text()
    assert "stopped cleanly" in text
    assert "Traceback" not in text and "Exception in ASGI" not in text, text
    assert "Cancel" not in text, text  # uvicorn never had to cancel a task itself
    short_events = results[0]["events"]
    assert results[0]["status"] == 200 and short_events[-1] == "[DONE]", results[0]
    chunks = [json.loads(e) for e in short_events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    for res in results[1:]:  # cancelled at the timeout: a final error event, then [DONE]
        assert "error" not in res and res["events"][-1] == "[DONE]", res
        err = json.loads(res["events"][-2])["error"]
        assert err["code"] == "server_shutting_down" and "shutdown-timeout" in err["message"]
    for res in plain:
        assert res.get("status") == 503, res
        assert res["body"]["error"]["code"] == "server_shutting_down"
