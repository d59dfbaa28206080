"""Admin routes (``replaylm serve --admin-api-key KEY``): weight updates, sleep and wake, the
prefix cache, behind ``Authorization: Bearer KEY``.

Without a key none of these routes exists (404); with one, a request without the right
bearer token gets 401 (compared with ``hmac.compare_digest``). An update or a sleep pauses
admission (new requests get 503 with ``Retry-After``), waits up to ``drain_timeout`` seconds
for the requests in flight to finish, ends those still running with finish_reason "abort",
acts on the engine thread (``EngineLoop.call``: the thread that owns the engine), and resumes;
a sleeping engine keeps refusing requests (503) until ``/admin/wake_up``. One admin action
runs at a time. ``/metrics`` counts each action and its seconds.

- ``POST /admin/update_weights`` ``{"path": DIR}``: ``Engine.update_weights(DIR)``
- ``POST /admin/sleep`` ``{"level": 1 | 2}``: ``Engine.sleep(level)``
- ``POST /admin/wake_up``: ``Engine.wake_up()``
- ``GET /admin/is_sleeping``: ``{"is_sleeping": bool}``
- ``POST /admin/reset_prefix_cache``: ``Engine.reset_prefix_cache()``
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request as HTTPRequest

from replaylm.engine.protocol import Engine
from replaylm.server.engine_loop import EngineLoop
from replaylm.server.metrics import ServerMetrics
from replaylm.server.protocol import APIError

log = logging.getLogger(__name__)

ASLEEP = "the engine is asleep (POST /admin/wake_up)"


def add_admin_routes(app: FastAPI, engine: EngineLoop, metrics: ServerMetrics, api_key: str,
                     drain_timeout: float) -> None:
    """Register the admin routes on ``app``, guarded by ``api_key``."""
    expected = f"Bearer {api_key}".encode()
    lock = asyncio.Lock()

    def authorize(request: HTTPRequest) -> None:
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            raise APIError("invalid or missing admin API key (Authorization: Bearer KEY)",
                           status=401, type_="authentication_error",
                           headers={"WWW-Authenticate": "Bearer"})

    async def body(request: HTTPRequest) -> dict:
        raw = await request.body()
        if not raw.strip():
            return {}
        try:
            value = json.loads(raw)
        except ValueError as e:
            raise APIError(f"the request body is not JSON: {e}") from None
        if not isinstance(value, dict):
            raise APIError("the request body must be a JSON object")
        return value

    async def act(action: str, fn: Callable[[Engine], Any], drain: bool,
                  pause: str | None = None) -> dict:
        """Pause admission (``drain``: and let in-flight requests finish), run ``fn`` on the
        engine thread, resume unless the engine sleeps; count it in ``/metrics``."""
        async with lock:
            t0 = time.perf_counter()
            previous = engine.paused
            try:
                if drain:
                    engine.paused = pause or f"paused for {action}"
                    aborted = await engine.drain(drain_timeout)
                    if aborted:
                        log.warning("%s: %d requests still running after --admin-drain-"
                                    "timeout=%g s were aborted", action, aborted, drain_timeout)
                try:
                    result = await engine.call(fn)
                except ValueError as e:
                    raise APIError(f"{action}: {e}") from None
                except RuntimeError as e:
                    raise APIError(f"{action}: {e}", status=409, code="conflict") from None
            finally:
                engine.paused = await engine.call(lambda c: ASLEEP if c.is_sleeping() else None)
                if previous is not None and engine.paused is None:
                    log.info("%s: admission resumed", action)
            seconds = time.perf_counter() - t0
            metrics.admin(action, seconds)
            log.info("%s done in %.2f s", action, seconds)
            if dataclasses.is_dataclass(result):
                result = dataclasses.asdict(result)
            return {"action": action, "seconds": seconds, "result": result}

    @app.post("/admin/update_weights")
    async def update_weights(request: HTTPRequest) -> dict:
        authorize(request)
        path = (await body(request)).get("path")
        if not isinstance(path, str) or not path:
            raise APIError("update_weights needs {\"path\": DIR}, a checkpoint directory on "
                           "the server", param="path")
        return await act("update_weights", lambda c: c.update_weights(path), drain=True)

    @app.post("/admin/sleep")
    async def sleep(request: HTTPRequest) -> dict:
        authorize(request)
        level = (await body(request)).get("level", 1)
        if level not in (1, 2) or isinstance(level, bool):
            raise APIError(f"sleep level must be 1 or 2, not {level!r}", param="level")
        return await act("sleep", lambda c: c.sleep(level), drain=True, pause="going to sleep")

    @app.post("/admin/wake_up")
    async def wake_up(request: HTTPRequest) -> dict:
        authorize(request)
        return await act("wake_up", lambda c: c.wake_up(), drain=False)

    @app.get("/admin/is_sleeping")
    async def is_sleeping(request: HTTPRequest) -> dict:
        authorize(request)
        return {"is_sleeping": bool(await engine.call(lambda c: c.is_sleeping()))}

    @app.post("/admin/reset_prefix_cache")
    async def reset_prefix_cache(request: HTTPRequest) -> dict:
        authorize(request)
        freed = await engine.call(lambda c: c.reset_prefix_cache())
        return {"action": "reset_prefix_cache", "result": {"blocks_freed": freed}}
