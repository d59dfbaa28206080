"""Connection hygiene: every request must arrive (headers and body) within a time limit.

uvicorn closes a kept-alive connection that stays idle between requests, but a connection
that sends nothing after connecting, only part of its headers, or only part of its body is
held open for as long as the client likes. ``TimedH11Protocol`` is uvicorn's h11 protocol
with a receive deadline: it starts when the connection opens and again when a response
completes, and stops once the request's last byte is in. When it passes first, a connection
that sent part of a request gets a 408 with OpenAI's error JSON and is closed (an application
waiting for the rest of the body sees a disconnect); one that sent nothing is just closed.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

#: Set in the ASGI scope of a request whose body did not arrive in time.
TIMED_OUT = "replaylm.request_timed_out"


def timed_h11_protocol(request_timeout: float,
                       on_timeout: Callable[[], None] | None = None) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a ``request_timeout``-second receive deadline;
    ``on_timeout`` is called for every request refused with a 408."""
    return type("TimedH11Protocol", (TimedH11Protocol,),
                {"request_timeout": request_timeout, "on_timeout": staticmethod(on_timeout)
                 if on_timeout is not None else None})


class TimedH11Protocol(H11Protocol):
    request_timeout: float = 30.0
    on_timeout: Callable[[], None] | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._deadline: asyncio.TimerHandle | None = None
        self._got_bytes = False
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._got_bytes = True
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE and self.conn.their_state is not h11.SEND_BODY:
            self._disarm()  # the whole request is in (or the connection is ending)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()  # the next request on this connection has the same time

    def _arm(self) -> None:
        self._disarm()
        self._got_bytes = False
        self._deadline = self.loop.call_later(self.request_timeout, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        cycle: Any = self.cycle
        state = self.conn.their_state
        if state is not h11.IDLE and state is not h11.SEND_BODY:
            return  # the request is in: it is being answered
        if cycle is not None and not cycle.response_complete and cycle.response_started:
            self.transport.close()  # answered before its body arrived; the body never came
            return
        if cycle is not None and not cycle.response_complete:
            # Headers arrived, the body did not: the application waiting for it sees a
            # disconnect, and whatever it sends later is dropped.
            cycle.scope[TIMED_OUT] = True
            cycle.disconnected = True
            cycle.message_event.set()
        elif not self._got_bytes:
            log.debug("closing a connection that sent nothing for %g s", self.request_timeout)
            self.transport.close()
            return
        log.info("a request was not received within %g s: answered 408 and closed",
                 self.request_timeout)
        if self.on_timeout is not None:
            self.on_timeout()
        body = json.dumps({"error": {
            "message": f"the request was not received within {self.request_timeout:g} s",
            "type": "invalid_request_error", "param": None, "code": "request_timeout"}}).encode()
        self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json"
                             b"\r\nconnection: close\r\ncontent-length: "
                             + str(len(body)).encode() + b"\r\n\r\n" + body)
        self.transport.close()
