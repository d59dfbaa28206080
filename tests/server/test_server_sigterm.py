"""``replaylm serve`` as a real process: SIGTERM drains in-flight work and exits 0."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    log_path = tmp_path / "serve.log"
    log = log_path.open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "replaylm", "serve", "--port", str(port), "--device", "cpu",
         "--shutdown-timeout", "2", "--log-level", "info"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, log_path.read_text()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)
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
        assert proc.wait(timeout=60) == 0, log_path.read_text()
        for t in threads:
            t.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    text = log_path.read_text()
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
