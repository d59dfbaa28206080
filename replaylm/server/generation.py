"""One HTTP generation request: its engine requests, their deltas, and its answer.

A request with ``k`` prompts and ``n`` choices becomes ``k * n`` engine requests (choice
``i * n + j``), all feeding one asyncio queue. A completion with ``echo`` opens each choice
with its prompt (text, and with logprobs the prompt's, from the first delta); one that only
scores its prompt (``max_tokens=0``) drops the token its engine request samples. ``close()`` is idempotent and always runs (end
of stream, disconnect, error): it aborts whatever is still running, which frees its KV blocks
at the engine loop's next command drain, and gives the admission slots back.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request as HTTPRequest
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from replaylm.engine.outputs import RequestDelta
from replaylm.lora.request import LoRARequest
from replaylm.sampling_params import SamplingParams
from replaylm.server.engine_loop import EngineFailure, EngineLoop, ShuttingDown
from replaylm.server.protocol import APIError, from_value_error
from replaylm.server.responses import (
    ChoiceState,
    Echo,
    LogprobFormatter,
    Shapes,
    merge_logprobs,
    sse,
    usage,
)
from replaylm.server.tool_calls import ToolCallStream, parse
from replaylm.server.tool_plan import ToolPlan


class Generation:
    """The engine requests behind one HTTP request, and their answer (streamed or whole)."""

    def __init__(self, loop: EngineLoop, shapes: Shapes, n_choices: int, include_usage: bool,
                 logprobs: LogprobFormatter | None, prompt_param: str,
                 echo: list[Echo] | None = None, score_only: bool = False,
                 tools: ToolPlan | None = None) -> None:
        """``echo``: the prompts to echo, one per prompt (None: no echo); ``score_only``:
        answer the echo alone, without the sampled token; ``tools``: a chat request's tool
        handling (its parser turns the output into ``tool_calls``)."""
        self.loop = loop
        self.shapes = shapes
        self.queue: asyncio.Queue = asyncio.Queue()
        self.choices = [ChoiceState() for _ in range(n_choices)]
        self.include_usage = include_usage
        self.logprobs = logprobs
        self.prompt_param = prompt_param
        self.echo = echo
        self.score_only = score_only
        self.tools = tools if tools is not None and tools.parser is not None else None
        self._n = 1  # choices per prompt
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self._open: dict[str, int] = {}  # engine request id -> choices still running
        self._base = uuid.uuid4().hex
        self._closed = False

    async def start(self, prompts: list[str | list[int]], params: list[SamplingParams],
                    n: int, lora_request: LoRARequest | None = None) -> None:
        """Add every engine request (under ``lora_request``'s adapter when given); a
        ``ValueError`` becomes a 400 (the caller closes).

        ``params`` has one entry per engine request of a prompt: ``[p]`` with ``p.n == n``
        when the engine runs the ``n`` siblings itself (they share the prompt's KV blocks),
        or ``n`` entries with ``n == 1`` each when the server fans them out.
        """
        self._n = n
        for i, prompt in enumerate(prompts):
            choice = i * n
            for j, sp in enumerate(params):
                rid = f"{self._base}-{choice}"
                self._open[rid] = sp.n
                try:
                    num_prompt = await self.loop.add(rid, prompt, sp, self.queue, choice,
                                                     lora_request)
                except ValueError as e:
                    del self._open[rid]
                    raise from_value_error(e, self.prompt_param) from e
                if j == 0:
                    self.prompt_tokens += num_prompt
                choice += sp.n

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for rid in self._open:
            self.loop.abort(rid)
        self._open.clear()
        self.loop.release(len(self.choices))

    async def deltas(self) -> AsyncIterator[tuple[int, str, RequestDelta,
                                                  dict[str, Any] | None]]:
        """Each delta with its choice index, its text (behind the echoed prompt on a choice's
        first delta) and formatted logprobs, until all choices end."""
        while self._open:
            choice, d = await self.queue.get()
            if isinstance(d, ShuttingDown):
                raise APIError(str(d), status=503, type_="server_error",
                               code="server_shutting_down")
            if isinstance(d, EngineFailure):
                raise APIError(str(d), status=500, type_="server_error")
            if d.finish_reason == "error":  # this request failed alone; the others go on
                raise APIError(f"request failed: {getattr(d, 'error', None) or 'unknown error'}",
                               status=500, type_="server_error")
            choice += getattr(d, "index", 0)
            if d.finished and d.request_id in self._open:
                self._open[d.request_id] -= 1
                if self._open[d.request_id] == 0:
                    del self._open[d.request_id]
            state = self.choices[choice]
            text, ids, entries = d.new_text, d.new_token_ids, getattr(d, "logprobs", None)
            if self.score_only:
                text, ids, entries = "", [], None if entries is None else []
            prefix, lp = "", None
            if self.echo is not None and not state.started:
                prompt = self.echo[choice // self._n]
                prefix = prompt.text
                if self.logprobs is not None:
                    lp = self.logprobs.format_prompt(prompt.token_ids, d.prompt_logprobs)
            state.started = True
            if self.logprobs is not None:
                offset = len(state.text) + len(prefix)
                lp = merge_logprobs(lp, self.logprobs.format(ids, entries, offset))
            text = prefix + text
            state.text += text
            state.token_ids.extend(ids)
            self.completion_tokens += len(ids)
            if d.finished:
                state.finish_reason = d.finish_reason
            yield choice, text, d, lp

    def usage(self) -> dict[str, int]:
        return usage(self.prompt_tokens, self.completion_tokens)

    async def collect(self, request: HTTPRequest) -> dict[str, Any] | None:
        """The whole answer; None if the client disconnected first (its requests are aborted)."""
        async def gather() -> dict[str, Any]:
            async for choice, _, _, lp in self.deltas():
                state = self.choices[choice]
                state.logprobs = merge_logprobs(state.logprobs, lp)
            if self.tools is not None:
                for state in self.choices:
                    parsed = parse(self.tools.parser, state.text, set(self.tools.names))
                    if parsed.calls:
                        state.text = parsed.content or ""
                        state.tool_calls = [c.as_dict() for c in parsed.calls]
                        state.finish_reason = "tool_calls"
            return self.shapes.final(self.choices, self.usage())

        work = asyncio.ensure_future(gather())
        gone = asyncio.ensure_future(wait_disconnect(request.receive))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (work, gone):
                task.cancel()
        return work.result() if work.done() and not work.cancelled() else None

    async def stream(self) -> AsyncIterator[str]:
        """Server-sent events: chunks, then the usage chunk if asked, then ``[DONE]``."""
        try:
            if self.shapes.chat:  # OpenAI opens each chat choice with the assistant role
                for i in range(len(self.choices)):
                    yield sse(self.shapes.chunk(i, "", None, role=True))
            calls = ([ToolCallStream(self.tools.parser, set(self.tools.names))
                      for _ in self.choices] if self.tools is not None else None)
            async for choice, text, d, lp in self.deltas():
                finish, new_calls = d.finish_reason, None
                if calls is not None:
                    text, new_calls = calls[choice].push(text, d.finished)
                    if d.finished and calls[choice].calls:
                        finish = "tool_calls"
                if text or d.finished or lp or new_calls:
                    shown = text if (text or not self.shapes.chat) else None
                    yield sse(self.shapes.chunk(choice, shown, finish, lp,
                                                tool_calls=new_calls))
            if self.include_usage:
                yield sse(self.shapes.usage_chunk(self.usage()))
        except APIError as e:  # headers are out: OpenAI streams the error as an event
            yield sse(e.body())
        finally:
            self.close()
        yield sse("[DONE]")


async def wait_disconnect(receive: Receive) -> None:
    """Return once the client has gone (the request body has been read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class GenerationStream(StreamingResponse):
    """A stream that closes its generation whatever happens, even if never iterated.

    An async generator that never started runs no ``finally``; a client gone before the first
    chunk would otherwise leave its requests running and its admission slots taken.
    """

    def __init__(self, gen: Generation) -> None:
        super().__init__(gen.stream(), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.gen = gen

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.gen.close()
