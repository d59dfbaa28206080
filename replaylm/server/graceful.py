"""uvicorn's server with SIGTERM meaning "stop accepting, drain, then exit 0"."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
from collections.abc import Callable, Iterator
from types import FrameType

import uvicorn

#: Seconds uvicorn's own drain outlasts ``--shutdown-timeout``: time for the requests cancelled
#: at the timeout to send their final error (an event and ``[DONE]``, or a 503 JSON).
SHUTDOWN_GRACE_S = 5.0


class GracefulServer(uvicorn.Server):
    """Drains like uvicorn (stop listening, let open responses finish), but at
    ``deadline_s`` calls ``on_deadline``, which must end every in-flight request with a final
    answer of its own; uvicorn's hard cancellation (``timeout_graceful_shutdown``, set
    ``SHUTDOWN_GRACE_S`` later) is then never reached, so no task is killed mid-response.
    Returns normally afterwards.

    uvicorn re-raises the captured signal once it has shut down, so the process dies by it
    (status 143) and a service manager reads a clean stop as a crash.
    """

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None],
                 on_deadline: Callable[[], None] | None = None,
                 deadline_s: float | None = None) -> None:
        super().__init__(config)
        self._on_exit = on_exit
        self._on_deadline = on_deadline
        self._deadline_s = deadline_s

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._on_exit()
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        timer = None
        if self._on_deadline is not None and self._deadline_s is not None:
            timer = asyncio.get_running_loop().call_later(self._deadline_s, self._on_deadline)
        try:
            await super().shutdown(sockets)
        finally:
            if timer is not None:
                timer.cancel()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        sigs = (signal.SIGINT, signal.SIGTERM)
        previous = {s: signal.signal(s, self.handle_exit) for s in sigs}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
