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
    except httpx.HTTPError as e:  # the cancelled request's connection is cut
        out["error"] = repr(e)
    finally:
        out["events"] = events
        first.set()


def test_sigterm_drains_then_exits_zero(tmp_path):
    log = tmp_path / "serve.log"
    with serve_process(log, "--shutdown-timeout", "2", "--log-level", "info") as (proc, url):
        # A short request that finishes while draining, and one too long for the timeout.
        short = {"prompt": "short", "max_tokens": 40, "ignore_eos": True, "stream": True}
        endless = {"prompt": "endless", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        results: list[dict] = [{}, {}]
        firsts = [threading.Event(), threading.Event()]
        threads = [threading.Thread(target=_read_stream, args=(url, b, f, r), daemon=True)
                   for b, f, r in zip((short, endless), firsts, results)]
        for t in threads:
            t.start()
        assert all(f.wait(60) for f in firsts)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(httpx.HTTPError):  # no longer accepting connections
            httpx.get(url + "/health", timeout=2)
        assert proc.wait(timeout=60) == 0, log.read_text()
        assert "stopped cleanly" in log.read_text()
        for t in threads:
            t.join(10)
    short_events = results[0]["events"]
    assert results[0]["status"] == 200 and short_events[-1] == "[DONE]", results[0]
    chunks = [json.loads(e) for e in short_events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    # The long one was either cancelled at the shutdown timeout or (fast machine) finished.
    long_events = results[1]["events"]
    assert long_events and (long_events[-1] == "[DONE]" or len(long_events) < 2000)
