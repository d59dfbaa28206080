"""A live server on loopback for the server tests: the built-in default model on CPU, run by
uvicorn in a background thread of the test process (so tests can also look at the engine)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from replaylm.config import EngineArgs
from replaylm.engine.core import EngineCore

# The server suite needs the server and test extras (scripts/setup.sh --test). Without them
# loading this file fails, and so does the run: CI must never pass with the suite skipped.
try:
    import fastapi  # noqa: F401
    import httpx  # noqa: F401
    import openai  # noqa: F401
    import prometheus_client  # noqa: F401
    import uvicorn
except ImportError as e:
    raise ImportError(f"the server tests need {e.name}: install the server and test extras "
                      "(scripts/setup.sh --test)") from e

MODEL = "default"


@dataclass
class LiveServer:
    url: str
    app: Any
    core: EngineCore

    @property
    def engine(self) -> Any:
        return self.app.state.engine

    def call(self, fn: Any, timeout: float = 10.0) -> Any:
        """Run ``fn(core)`` on the engine thread (the core is not thread-safe) and wait."""
        import asyncio

        return asyncio.run(asyncio.wait_for(self.engine.call(fn), timeout))

    def wait_idle(self, timeout: float = 20.0) -> None:
        """Until no request is in flight and no KV block is held; then check integrity."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.engine.in_flight == 0 and self.call(
                    lambda c: not c.has_unfinished() and c.block_manager.num_used_blocks == 0):
                break
            time.sleep(0.05)
        else:
            used = self.call(lambda c: c.block_manager.num_used_blocks)
            raise AssertionError(f"not idle after {timeout}s: in_flight={self.engine.in_flight}, "
                                 f"blocks used={used}")
        self.call(lambda c: c.scheduler.check_integrity())


@contextlib.contextmanager
def serve(core: EngineCore, request_timeout: float = 30.0,
          **app_kwargs: Any) -> Iterator[LiveServer]:
    """``core`` served on a free loopback port by uvicorn in a background thread, with the
    settings ``replaylm serve`` uses."""
    from replaylm.server.app import build_app
    from replaylm.server.serve import uvicorn_config

    app = build_app(core, **app_kwargs)
    config = uvicorn_config(app, "127.0.0.1", 0, "warning", request_timeout,
                            shutdown_timeout=5)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield LiveServer(f"http://127.0.0.1:{port}", app, core)
    finally:
        server.should_exit = True
        thread.join(15)


@pytest.fixture(scope="session")
def live_server() -> Iterator[LiveServer]:
    with serve(EngineCore(EngineArgs(model=MODEL, device="cpu")), max_queue=512) as server:
        yield server


@pytest.fixture(scope="session")
def reference_llm() -> Any:
    """A separate offline engine on the same model: what the server must reproduce."""
    from replaylm import LLM

    return LLM(MODEL, device="cpu")
