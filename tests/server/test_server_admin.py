"""Admin routes (``--admin-api-key``): absent without a key, 401 without the right bearer
token; sleep refuses requests with 503 until wake, outputs come back the same, a level-2
sleep comes back through ``/admin/update_weights``, a sleep past the drain timeout aborts the
request in flight, and ``/metrics`` counts it all."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from replaylm.config import EngineArgs
from replaylm.engine.core import EngineCore
from replaylm.engine.loading import load_model_config, resolve_weights_dir
from replaylm.server.app import build_app
from tests.server.conftest import serve

KEY = "s3cret"
AUTH = {"Authorization": f"Bearer {KEY}"}
GREEDY = {"model": "default", "prompt": "def fibonacci(n):", "temperature": 0.0,
          "max_tokens": 6, "ignore_eos": True}


@pytest.fixture(scope="module")
def admin_server():
    core = EngineCore(EngineArgs(model="default", device="cpu", enable_sleep_mode=True,
                                 enforce_eager=True, max_num_seqs=4, max_model_len=512,
                                 num_kv_blocks=40))
    with serve(core, max_queue=16, admin_api_key=KEY, admin_drain_timeout=0.3) as server:
        yield server


def _complete(url: str) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=GREEDY, timeout=60)


def _admin_counts(url: str) -> dict[str, float]:
    """``/metrics``' admin action counters by action (each test reads its own increments:
    the module's tests share one server and may run in any order, or alone)."""
    counts = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("replaylm_admin_actions_total{"):
            action = line.split('action="', 1)[1].split('"', 1)[0]
            counts[action] = float(line.split()[-1])
    return counts


def test_admin_routes_do_not_exist_without_a_key(admin_server):
    client = TestClient(build_app(admin_server.core))  # no lifespan: routing alone
    for method, path in (("post", "/admin/sleep"), ("post", "/admin/wake_up"),
                         ("get", "/admin/is_sleeping"), ("post", "/admin/update_weights"),
                         ("post", "/admin/reset_prefix_cache")):
        r = getattr(client, method)(path, headers=AUTH)
        assert r.status_code == 404, (path, r.text)


def test_a_wrong_or_missing_key_is_401(admin_server):
    url = admin_server.url
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": KEY}):
        r = httpx.post(url + "/admin/sleep", json={"level": 1}, headers=headers)
        assert r.status_code == 401, r.text
        assert r.headers.get("www-authenticate") == "Bearer"
    r = httpx.get(url + "/admin/is_sleeping", headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401
    assert httpx.get(url + "/admin/is_sleeping", headers=AUTH).json() == {"is_sleeping": False}


def test_sleep_refuses_requests_until_wake_and_outputs_come_back(admin_server):
    url = admin_server.url
    before = _complete(url)
    assert before.status_code == 200, before.text
    text = before.json()["choices"][0]["text"]
    r = httpx.post(url + "/admin/sleep", json={"level": 1}, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["result"]["level"] == 1
    assert httpx.get(url + "/admin/is_sleeping", headers=AUTH).json() == {"is_sleeping": True}
    asleep = _complete(url)
    assert asleep.status_code == 503 and "asleep" in asleep.text
    assert asleep.headers.get("retry-after")
    again = httpx.post(url + "/admin/sleep", json={"level": 1}, headers=AUTH, timeout=60)
    assert again.status_code == 409, again.text
    r = httpx.post(url + "/admin/wake_up", headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    after = _complete(url)
    assert after.status_code == 200 and after.json()["choices"][0]["text"] == text
    admin_server.wait_idle()


def test_level2_sleep_then_update_weights_through_the_route(admin_server):
    url = admin_server.url
    before = _admin_counts(url)
    text = _complete(url).json()["choices"][0]["text"]
    cfg, model_dir = load_model_config("default")
    weights = str(resolve_weights_dir(model_dir, cfg, "auto"))  # the weights it loaded
    assert httpx.post(url + "/admin/sleep", json={"level": 2}, headers=AUTH,
                      timeout=60).status_code == 200
    bad = httpx.post(url + "/admin/sleep", json={"level": 3}, headers=AUTH)
    assert bad.status_code == 400
    assert httpx.post(url + "/admin/wake_up", headers=AUTH, timeout=60).status_code == 200
    missing = httpx.post(url + "/admin/update_weights", json={"path": "/no/such/dir"},
                         headers=AUTH, timeout=60)
    assert missing.status_code == 400 and "checkpoint directory" in missing.text
    r = httpx.post(url + "/admin/update_weights", json={"path": weights}, headers=AUTH,
                   timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["result"]["tensors"] > 0
    assert _complete(url).json()["choices"][0]["text"] == text
    r = httpx.post(url + "/admin/reset_prefix_cache", headers=AUTH)
    assert r.status_code == 200 and "blocks_freed" in r.json()["result"]
    admin_server.wait_idle()
    after = _admin_counts(url)
    # Counted: the good sleep and update (a refused request is not an action).
    assert after["update_weights"] - before.get("update_weights", 0.0) == 1.0
    assert after["sleep"] - before.get("sleep", 0.0) == 1.0
    metrics = httpx.get(url + "/metrics").text
    assert 'replaylm_admin_seconds_total{action="update_weights"}' in metrics


def test_sleep_past_the_drain_timeout_aborts_the_request_in_flight(admin_server):
    url = admin_server.url
    before = _admin_counts(url)
    long = dict(GREEDY, max_tokens=400)
    got: dict = {}

    def run() -> None:
        got["r"] = httpx.post(url + "/v1/completions", json=long, timeout=120)

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 10  # until the request is running in the engine
    while admin_server.engine.in_flight == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    r = httpx.post(url + "/admin/sleep", json={"level": 1}, headers=AUTH, timeout=60)
    t.join(60)
    assert r.status_code == 200, r.text
    assert got["r"].json()["choices"][0]["finish_reason"] == "abort", got["r"].text
    assert httpx.post(url + "/admin/wake_up", headers=AUTH, timeout=60).status_code == 200
    assert _complete(url).status_code == 200
    admin_server.wait_idle()
    metrics = httpx.get(url + "/metrics").text
    for action in ("sleep", "wake_up"):
        assert f'replaylm_admin_seconds_total{{action="{action}"}}' in metrics
    after = _admin_counts(url)
    for action in ("sleep", "wake_up"):
        assert after[action] - before.get(action, 0.0) == 1.0, (before, after)
