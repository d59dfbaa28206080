"""A live server on loopback for the server tests: the built-in default model on CPU, run by
uvicorn in a background thread of the test process (so tests can also look at the engine)."""

from __future__ import annotations

import importlib.util
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from replaylm.config import EngineArgs
from replaylm.engine.core import EngineCore

MODEL = "default"
_NEEDED = ("fastapi", "uvicorn", "prometheus_client", "httpx", "openai")
if any(importlib.util.find_spec(m) is None for m in _NEEDED):
    # Without the server and test extras there is nothing here to run (plain setup.sh).
    collect_ignore_glob = ["test_*.py"]


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


@pytest.fixture(scope="session")
def live_server() -> Iterator[LiveServer]:
    import uvicorn

    from replaylm.server.app import build_app

    core = EngineCore(EngineArgs(model=MODEL, device="cpu"))
    app = build_app(core, max_queue=512)
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                            timeout_graceful_shutdown=5)
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
def reference_llm() -> Any:
    """A separate offline engine on the same model: what the server must reproduce."""
    from replaylm import LLM

    return LLM(MODEL, device="cpu")
