"""One background thread owns the engine (``engine.protocol.Engine``) and drives ``step()``;
the event loop talks to it.

An engine is not thread-safe, so nothing outside this thread touches it: adds, aborts and
any other engine call are queued as commands and run here between steps (FIFO, so an abort
queued after an add always finds its request). Deltas go back to each request's
``asyncio.Queue`` through ``loop.call_soon_threadsafe``. With nothing to run, the thread sleeps
on a condition variable; it wakes for a command or for shutdown, never polls.

A request that fails alone (``finish_reason="error"``) is just another finished request. If
``step()`` itself raises, the engine is at fault: every in-flight request fails, the loop
stops stepping, and ``alive`` turns False for good (``/health`` answers 503, so an
orchestrator restarts the process).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from replaylm.engine.outputs import RequestDelta
from replaylm.engine.protocol import Engine
from replaylm.lora.request import LoRARequest
from replaylm.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class LoopMetrics(Protocol):
    """What the loop reports per request (implemented by ``server.metrics.ServerMetrics``)."""

    def first_token(self, seconds: float) -> None: ...
    def output_tokens(self, seconds_per_token: float, n: int) -> None: ...
    def finished(self, reason: str, e2e_seconds: float) -> None: ...


class EngineFailure(RuntimeError):
    """Put on a request's queue when ``step()`` raised: the request cannot complete."""


class NotAccepting(RuntimeError):
    """The loop is shutting down (or stopped) and takes no new work."""


class ShuttingDown(EngineFailure):
    """Put on a request's queue when shutdown cancels it (past ``--shutdown-timeout``)."""


@dataclass
class _Stream:
    """Where one engine request's deltas go; with native ``n > 1`` its siblings share it."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    choice: int
    arrival: float
    unfinished: set[int] = field(default_factory=lambda: {0})  # sibling indices running
    last_token_at: dict[int, float] = field(default_factory=dict)  # sibling index -> time

    def put(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            pass  # the event loop has closed: nobody is left to read this


class EngineLoop:
    """Drives one engine from a daemon thread; admission control for the server.

    ``admit``/``release`` count in-flight engine requests on the event-loop side; above
    ``max_queue`` the server answers 503 instead of queueing without bound.
    """

    def __init__(self, core: Engine, max_queue: int = 1024,
                 metrics: LoopMetrics | None = None) -> None:
        self.core = core
        self.max_queue = max_queue
        self.metrics = metrics
        self.accepting = True
        # Why admission is paused (an admin action, or the engine sleeps), or None: new
        # requests get 503 meanwhile (``server.admin``).
        self.paused: str | None = None
        self.in_flight = 0  # event-loop thread only
        self.fault: str | None = None  # set once step() raised: the engine is unusable
        self._cancelled: str | None = None  # set by cancel_all: adds are refused from then on
        self._cond = threading.Condition()
        self._commands: list[Callable[[], None]] = []
        self._stopping = False
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._thread = threading.Thread(target=self._run, name="replaylm-engine", daemon=True)

    # Event-loop side -------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping and self.fault is None

    def admit(self, k: int) -> bool:
        """Reserve ``k`` engine requests; False when full or shutting down."""
        if (not self.accepting or self.paused is not None or not self.alive
                or self.in_flight + k > self.max_queue):
            return False
        self.in_flight += k
        return True

    def release(self, k: int) -> None:
        self.in_flight -= k

    async def add(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                  queue: asyncio.Queue, choice: int = 0,
                  lora_request: LoRARequest | None = None) -> int:
        """Queue a request (``lora_request``: its LoRA adapter, None: the base model);
        returns its prompt length. Deltas arrive as ``(choice, delta)``
        (with ``params.n > 1``, sibling ``delta.index`` is choice ``choice + index``).

        Raises the engine's ``ValueError`` for a bad request (nothing was added then).
        """
        loop = asyncio.get_running_loop()

        def add(core: Engine) -> int:
            if self._cancelled is not None:
                raise NotAccepting(self._cancelled)
            req = core.add_request(request_id, prompt, params, lora_request=lora_request)
            self._streams[request_id] = _Stream(loop, queue, choice, time.monotonic(),
                                                unfinished=set(range(params.n)))
            return req.num_prompt_tokens

        return await self.call(add)

    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        """Run ``fn(core)`` on the engine thread between steps and return its result."""
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def command() -> None:
            if not fut.set_running_or_notify_cancel():
                return  # the caller went away before we got to it
            try:
                fut.set_result(fn(self.core))
            except BaseException as e:  # handed to the caller, never kills the loop
                fut.set_exception(e)

        self._submit(command)
        return await asyncio.wrap_future(fut)

    async def drain(self, timeout: float, poll_s: float = 0.01) -> int:
        """Wait (admission paused by the caller) until no request is in flight; past
        ``timeout`` seconds end those still running with finish_reason "abort" and wait for
        their readers to let go. Returns how many engine requests were aborted."""
        deadline = time.monotonic() + timeout
        while self.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(poll_s)
        if self.in_flight == 0:
            return 0

        def abort_all(_: Engine) -> int:
            ids = list(self._streams)
            for rid in ids:
                self._abort(rid)
            return len(ids)

        aborted = await self.call(abort_all)
        deadline = time.monotonic() + max(timeout, 5.0)
        while self.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(poll_s)
        return aborted

    def abort(self, request_id: str) -> None:
        """Cancel a request and free its KV blocks at the next command drain (thread-safe)."""
        try:
            self._submit(lambda: self._abort(request_id))
        except NotAccepting:
            pass  # the loop aborts everything itself when it stops

    def cancel_all(self, reason: str) -> None:
        """End every in-flight request now (shutdown past its timeout): each reader gets
        ``ShuttingDown(reason)``, and requests still on their way in are refused. Thread-safe."""
        def cancel() -> None:
            self._cancelled = reason
            now = time.monotonic()
            for rid, s in list(self._streams.items()):
                self.core.abort(rid)
                if self.metrics is not None:
                    for _ in s.unfinished:
                        self.metrics.finished("abort", now - s.arrival)
                s.put((s.choice, ShuttingDown(reason)))
            self._streams.clear()

        try:
            self._submit(cancel)
        except NotAccepting:
            pass  # the loop has stopped: it aborted everything itself

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the thread: queued commands run, then every unfinished request is aborted."""
        self.accepting = False
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _submit(self, command: Callable[[], None]) -> None:
        with self._cond:
            if self._stopping:
                raise NotAccepting("the engine loop is shutting down")
            self._commands.append(command)
            self._cond.notify()

    # Engine thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        busy = False
        while True:
            with self._cond:
                while not self._commands and not busy and not self._stopping:
                    self._cond.wait()
                commands, self._commands = self._commands, []
                stopping = self._stopping
            for command in commands:
                try:
                    command()
                except Exception:  # an abort that raised must not take the loop down
                    log.exception("engine command failed")
            if stopping:
                for rid in list(self._streams):
                    self._abort(rid)
                return
            if self.fault is None and self.core.has_unfinished():
                try:
                    self._dispatch(self.core.step())
                except Exception as e:  # an engine fault: fail everything, never hang
                    log.exception("engine step failed: failing every in-flight request; the "
                                  "server reports unhealthy from now on")
                    self.fault = f"{type(e).__name__}: {e}"
                    self._fail_all(e)
            busy = self.fault is None and self.core.has_unfinished()

    def _dispatch(self, deltas: list[RequestDelta]) -> None:
        now = time.monotonic()
        for d in deltas:
            s = self._streams.get(d.request_id)
            if s is None:
                continue
            sibling = getattr(d, "index", 0)
            if d.new_token_ids and self.metrics is not None:
                last = s.last_token_at.get(sibling)
                if last is None:
                    self.metrics.first_token(now - s.arrival)
                else:
                    n = len(d.new_token_ids)
                    self.metrics.output_tokens((now - last) / n, n)
            if d.new_token_ids:
                s.last_token_at[sibling] = now
            if d.finished:
                s.unfinished.discard(sibling)
                if not s.unfinished:
                    del self._streams[d.request_id]
                if self.metrics is not None:
                    self.metrics.finished(d.finish_reason or "unknown", now - s.arrival)
            s.put((s.choice, d))

    def _abort(self, request_id: str) -> None:
        self.core.abort(request_id)
        s = self._streams.pop(request_id, None)
        if s is None:
            return
        e2e = time.monotonic() - s.arrival
        # A reader still waiting (shutdown, not a disconnect) sees every sibling end.
        for sibling in sorted(s.unfinished):
            if self.metrics is not None:
                self.metrics.finished("abort", e2e)
            d = RequestDelta(request_id, [], "", True, "abort")
            d.index = sibling  # set, not passed: builds without n > 1 have no such field
            s.put((s.choice, d))

    def _fail_all(self, err: Exception) -> None:
        for rid, s in list(self._streams.items()):
            try:
                self.core.abort(rid)
            except Exception:
                log.exception("abort of %s after a failed step also failed", rid)
            s.put((s.choice, EngineFailure(f"engine step failed: {err}")))
        self._streams.clear()
