"""uvicorn's server with SIGTERM meaning "stop accepting, drain, then exit 0"."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator
from types import FrameType

import uvicorn


class GracefulServer(uvicorn.Server):
    """Drains like uvicorn (stop listening, finish open responses for up to
    ``timeout_graceful_shutdown`` seconds, then cancel them, then the lifespan shutdown), but
    returns normally afterwards.

    uvicorn re-raises the captured signal once it has shut down, so the process dies by it
    (status 143) and a service manager reads a clean stop as a crash.
    """

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._on_exit()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        sigs = (signal.SIGINT, signal.SIGTERM)
        previous = {s: signal.signal(s, self.handle_exit) for s in sigs}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
