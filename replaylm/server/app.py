"""The FastAPI application: OpenAI endpoints over one ``EngineLoop``.

Request handling order matters for robustness: read the body within the size limit (413; a
client gone mid-upload is logged once at info and counted as 499), parse and validate it (400), check the
model (404 ``model_not_found``), refuse what could never be admitted (400), take admission
slots (503 + Retry-After), and only then touch the engine. Every failure path answers OpenAI's
error JSON (unknown routes and methods too); nothing a client sends can stop the server.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HTTPRequest

from replaylm.engine.outputs import RequestDelta
from replaylm.engine.protocol import Engine
from replaylm.lora.request import LoRARequest
from replaylm.server.connections import TIMED_OUT
from replaylm.server.engine_loop import EngineLoop, NotAccepting
from replaylm.server.generation import Generation, GenerationStream
from replaylm.server.lora import ServedAdapters, add_lora_routes
from replaylm.server.metrics import CONTENT_TYPE, ServerMetrics
from replaylm.server.prompts import PromptWorkers
from replaylm.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    engine_supports,
    from_validation_error,
    from_value_error,
    native_n_supported,
    sampling_params,
    structured_params,
)
from replaylm.server.responses import Echo, LogprobFormatter, Shapes
from replaylm.server.tool_calls import PARSERS
from replaylm.server.tool_plan import tool_plan

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1  # a queue slot frees as soon as any in-flight request ends
CLIENT_GONE = 499  # the metrics label of requests whose client left before sending all of it
#: A body over the size limit but under this many times it is read to its end (and dropped)
#: before the 413, so the client, still sending, reads the answer instead of a reset
#: connection; a larger one is answered at once and the connection closed.
DRAIN_FACTOR = 4
Body = TypeVar("Body", CompletionRequest, ChatCompletionRequest)


class ClientGone(Exception):
    """The client closed the connection before its request body was in."""


def logprobs_supported() -> bool:
    """Logprobs need both the request field and the engine's per-delta entries."""
    delta_fields = {f.name for f in dataclasses.fields(RequestDelta)}
    return engine_supports("logprobs") and "logprobs" in delta_fields


def build_app(core: Engine, max_queue: int = 1024,
              served_model_name: str | None = None,
              max_request_bytes: int = 8 * 2**20, admin_api_key: str | None = None,
              admin_drain_timeout: float = 30.0,
              tool_call_parser: str | None = None, lora_modules: dict[str, str] | None = None,
              enable_lora_updates: bool = False) -> FastAPI:
    """An app serving ``core`` (one engine, or the driver of data- and tensor-parallel
    workers); its engine loop starts and stops with the app's lifespan. Request bodies above
    ``max_request_bytes`` are answered 413. ``admin_api_key``: serve the admin routes
    (``server.admin``) to holders of this bearer token. ``tool_call_parser``: how chat
    outputs are read for tool calls (``server.tool_calls.PARSERS``; None: only forced calls,
    in the default format). ``lora_modules``: LoRA adapters served by name
    (``server.lora``), loaded now; ``enable_lora_updates``: serve the adapter load/unload
    routes without an admin key."""
    if tool_call_parser is not None and tool_call_parser not in PARSERS:
        raise ValueError(f"tool_call_parser={tool_call_parser!r} is invalid: must be one of "
                         f"{', '.join(PARSERS)}")
    served = served_model_name or core.args.model
    aliases = {served, core.args.model, core.model_config.name}
    adapters = ServedAdapters()
    adapters.add_at_start(core, lora_modules or {})
    # Read at scrape time on the event loop's thread: a driver's live view, never its pipes.
    stats = core.live_stats
    metrics = ServerMetrics(lambda: stats, lambda: engine.in_flight)
    engine = EngineLoop(core, max_queue=max_queue, metrics=metrics)
    workers = PromptWorkers(core)
    with_logprobs = logprobs_supported()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            workers.shutdown()
            engine.shutdown()

    app = FastAPI(title="replaylm", lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.served_model_name = served
    app.state.max_request_bytes = max_request_bytes
    # Whether the engine runs n > 1 siblings itself; if not, the server fans choices out.
    app.state.native_n = native_n_supported()

    @app.exception_handler(APIError)
    async def api_error(_: HTTPRequest, e: APIError) -> JSONResponse:
        metrics.http_error(e.status)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: HTTPRequest, e: HTTPException) -> JSONResponse:
        """Routing errors (404, 405) in OpenAI's shape rather than ``{"detail": ...}``."""
        metrics.http_error(e.status_code)
        where = f"{request.method} {request.url.path}"
        message = {404: f"Invalid URL ({where})",
                   405: f"Method not allowed ({where})"}.get(e.status_code, str(e.detail))
        err = APIError(message, status=e.status_code)
        return JSONResponse(err.body(), status_code=e.status_code, headers=e.headers)

    @app.exception_handler(ClientGone)
    async def client_gone(request: HTTPRequest, _: ClientGone) -> Response:
        if not request.scope.get(TIMED_OUT):  # a timeout was logged and counted as 408
            log.info("client %s closed the connection while sending its request",
                     request.client.host if request.client else "?")
            metrics.http_error(CLIENT_GONE)
        return Response(status_code=CLIENT_GONE)  # nobody reads it

    @app.exception_handler(Exception)
    async def unexpected(_: HTTPRequest, e: Exception) -> JSONResponse:
        log.exception("unhandled error")
        metrics.http_error(500)
        err = APIError(f"internal error: {type(e).__name__}: {e}", status=500,
                       type_="server_error")
        return JSONResponse(err.body(), status_code=500)

    async def read_body(request: HTTPRequest) -> bytes:
        limit = app.state.max_request_bytes
        too_large = APIError(f"request body exceeds the server's limit of {limit} bytes",
                             status=413, code="request_too_large",
                             headers={"Connection": "close"})
        declared = request.headers.get("content-length", "")
        over = declared.isdigit() and int(declared) > limit
        if over and int(declared) > DRAIN_FACTOR * limit:
            raise too_large  # refused before reading any of it
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if over or size > limit:  # over the limit: read on, keep nothing
                    over = True
                    chunks.clear()
                    if size > DRAIN_FACTOR * limit:
                        break
                    continue
                chunks.append(chunk)
        except ClientDisconnect:
            raise ClientGone() from None
        if over:
            raise too_large
        return b"".join(chunks)

    async def parse(request: HTTPRequest, model: type[Body]) -> tuple[Body, LoRARequest | None]:
        """The body and the LoRA adapter its ``model`` names (None: the base model)."""
        raw = await read_body(request)
        try:
            body = model.model_validate_json(raw)
        except ValidationError as e:
            raise from_validation_error(e) from None
        if body.model is None or body.model in aliases:
            return body, None
        lora = adapters.by_name.get(body.model)
        if lora is None:
            raise APIError(f"The model {body.model!r} does not exist: this server serves "
                           f"{served!r}" + "".join(f", {n!r}" for n in adapters.by_name),
                           param="model", status=404, code="model_not_found")
        return body, lora

    async def generate(request: HTTPRequest, body: CompletionRequest | ChatCompletionRequest,
                       prompts: list[str | list[int]] | None,
                       lora: LoRARequest | None = None) -> Any:
        chat = isinstance(body, ChatCompletionRequest)
        param = "messages" if chat else "prompt"
        tools = tool_plan(body, tool_call_parser) if chat else None
        forced = tools.constraint if tools is not None else None
        source = "tools" if forced is not None else structured_params(body)[1]
        # Only sibling 0 of an engine-run group scores the prompt: echoed prompt logprobs
        # for every choice need a request per choice.
        per_choice_prompt = not chat and body.prompt_logprobs is not None
        try:  # every choice's params first: a bad value must not leave siblings running
            if (app.state.native_n and not per_choice_prompt) or body.n == 1:
                params = [sampling_params(body, 0, with_logprobs, n=body.n, tool_constraint=forced)]
            else:
                params = [sampling_params(body, j, with_logprobs, tool_constraint=forced)
                          for j in range(body.n)]
            await workers.check(params)
        except ValueError as e:
            raise from_value_error(e, param, source) from e
        k = body.n * (1 if prompts is None else len(prompts))
        if k > engine.max_queue:  # could never be admitted: the client must split it
            field = "n" if body.n > engine.max_queue else param
            raise APIError(f"this request needs {k} engine requests (n={body.n} per prompt) but "
                           f"the server holds at most {engine.max_queue} at once: lower {field}",
                           param=field)
        if not engine.admit(k):
            why = (engine.paused if engine.paused is not None
                   else "the engine failed" if engine.fault is not None
                   else "shutting down" if not engine.accepting
                   else f"queue full ({engine.max_queue})")
            raise APIError(f"server busy: {why}; retry later", status=503, type_="server_error",
                           code="overloaded", headers={"Retry-After": str(RETRY_AFTER_S)})
        top_k = params[0].logprobs if with_logprobs and params[0].logprobs is not None else None
        lp = None if top_k is None else LogprobFormatter(core.tokenizer, chat, top_k)
        response_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        shapes = Shapes(response_id, int(time.time()),
                        served if lora is None else lora.lora_name, chat)
        echo = not chat and body.echo
        gen = Generation(engine, shapes, k, body.include_usage, lp, param,
                         score_only=not chat and body.score_only, tools=tools)
        try:
            try:  # on the prompt workers: a long prompt never stalls the engine thread
                if chat:
                    ids = [await workers.chat_ids([m.as_template_dict() for m in body.messages],
                                                  body.template_tools())]
                else:
                    ids = list(await asyncio.gather(*(workers.prompt_ids(p) for p in prompts)))
                if echo:
                    gen.echo = [Echo(p if isinstance(p, str) else await workers.prompt_text(i), i)
                                for p, i in zip(prompts, ids)]
            except ValueError as e:
                raise from_value_error(e, param) from e
            await gen.start(ids, params, body.n, lora)
        except NotAccepting:
            gen.close()
            raise APIError("server is shutting down", status=503, type_="server_error",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except BaseException:
            gen.close()
            raise
        if body.stream:
            return GenerationStream(gen)
        try:
            answer = await gen.collect(request)
        finally:
            gen.close()
        return Response(status_code=499) if answer is None else JSONResponse(answer)

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest) -> Any:
        body, lora = await parse(request, CompletionRequest)
        return await generate(request, body, body.prompts(), lora)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest) -> Any:
        body, lora = await parse(request, ChatCompletionRequest)
        return await generate(request, body, None, lora)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": served, "object": "model", "created": 0, "owned_by": "replaylm",
            "max_model_len": core.max_model_len,
        }, *adapters.model_cards(served)]}

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = engine.alive
        return JSONResponse({"status": "ok" if ok else "unavailable"},
                            status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    if admin_api_key or enable_lora_updates:
        add_lora_routes(app, engine, adapters, admin_api_key)
    if admin_api_key:
        from replaylm.server.admin import add_admin_routes

        add_admin_routes(app, engine, metrics, admin_api_key, admin_drain_timeout)

    return app
