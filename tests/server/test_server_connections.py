"""Connection hygiene over raw loopback sockets: a request must arrive within the time limit
(else 408 and close), an idle new connection is closed, bodies are size-limited (413), and a
client gone mid-upload is an info line and a 499 count, never a 500."""

from __future__ import annotations

import json
import logging
import socket
import time

import httpx
import pytest

from replaylm.config import EngineArgs
from replaylm.engine.core import EngineCore
from tests.server.conftest import serve

TIMEOUT = 1.0
LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def server():
    core = EngineCore(EngineArgs(model="default", device="cpu"))
    with serve(core, request_timeout=TIMEOUT, max_request_bytes=LIMIT) as s:
        yield s


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes (or 10 s pass)."""
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, TimeoutError):
            return data
        if not chunk:
            return data
        data += chunk


def _metric(url: str, status: int) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(f'replaylm_http_errors_total{{status="{status}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _head(length: int) -> bytes:
    return (f"POST /v1/completions HTTP/1.1\r\nHost: test\r\ncontent-type: application/json"
            f"\r\ncontent-length: {length}\r\n\r\n").encode()


def test_connection_that_sends_nothing_is_closed(server):
    sock = _connect(server.url)
    t0 = time.monotonic()
    assert _read_all(sock) == b""  # closed without a word
    assert TIMEOUT * 0.8 < time.monotonic() - t0 < TIMEOUT + 3
    sock.close()


@pytest.mark.parametrize("sent", [
    b"POST /v1/completions HTTP/1.1\r\nHost: te",  # half the headers
    _head(100) + b'{"prompt": ',  # headers, then part of the body
], ids=["partial-headers", "partial-body"])
def test_incomplete_request_gets_408_and_is_closed(server, sent):
    before = _metric(server.url, 408)
    sock = _connect(server.url)
    sock.sendall(sent)
    t0 = time.monotonic()
    reply = _read_all(sock)
    sock.close()
    assert TIMEOUT * 0.8 < time.monotonic() - t0 < TIMEOUT + 3
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), reply
    assert json.loads(body)["error"]["code"] == "request_timeout"
    assert _metric(server.url, 408) == before + 1


def test_slow_answers_and_kept_alive_connections_are_not_cut(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        r = client.post("/v1/completions", json={"prompt": "long", "max_tokens": 150,
                                                 "ignore_eos": True})
        assert r.status_code == 200  # answering may take longer than the receive limit
        time.sleep(TIMEOUT / 2)
        with client.stream("POST", "/v1/completions", json={
                "prompt": "stream", "max_tokens": 150, "ignore_eos": True,
                "stream": True}) as s:
            lines = [x for x in s.iter_lines() if x.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
    server.wait_idle()


def test_body_over_the_limit_is_413(server):
    big = json.dumps({"prompt": "x" * LIMIT}).encode()
    r = httpx.post(server.url + "/v1/completions", content=big, timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no content-length: counted while read
        for i in range(0, len(big), 4096):
            yield big[i:i + 4096]

    r = httpx.post(server.url + "/v1/completions", content=chunks(), timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    ok = httpx.post(server.url + "/v1/completions", timeout=30,
                    json={"prompt": "x" * (LIMIT // 2), "max_tokens": 1})
    assert ok.status_code == 400 and ok.json()["error"]["param"] == "prompt"  # read, parsed


def test_client_gone_mid_upload_is_info_and_499(server, caplog):
    before_499, before_500 = _metric(server.url, 499), _metric(server.url, 500)
    with caplog.at_level(logging.INFO, logger="replaylm"):
        sock = _connect(server.url)
        sock.sendall(_head(1000) + b'{"prompt": "abc')
        time.sleep(0.2)
        sock.close()
        deadline = time.monotonic() + 5
        while _metric(server.url, 499) == before_499 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert _metric(server.url, 499) == before_499 + 1
    assert _metric(server.url, 500) == before_500
    gone = [r for r in caplog.records if "closed the connection" in r.getMessage()]
    assert len(gone) == 1 and gone[0].levelno == logging.INFO and gone[0].exc_info is None
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
