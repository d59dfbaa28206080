"""LoRA adapters in the server (``replaylm serve --enable-lora --lora-modules name=path ...``).

A request's ``model`` picks what it runs with: the served model name (or the model's own
names) is the base model, an adapter's name that adapter, anything else a 404
``model_not_found``. ``GET /v1/models`` lists the base and every adapter (``parent``: the
base, ``root``: the adapter's path).

vLLM's runtime routes, ``{"lora_name": NAME, "lora_path": DIR}``:

- ``POST /v1/load_lora_adapter``: read and check the adapter on the engine thread (a bad
  adapter or a taken name is a 400), then serve it under ``lora_name``;
- ``POST /v1/unload_lora_adapter``: stop serving it (404 if unknown); requests running with
  it finish with it.

They exist behind ``--admin-api-key`` (``Authorization: Bearer KEY``, as ``server.admin``)
when a key is set, else only with ``--enable-lora-updates``; otherwise they are 404.
"""

from __future__ import annotations

import hmac
import itertools
import json
import logging
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request as HTTPRequest

from replaylm.engine.protocol import Engine
from replaylm.lora.request import LoRARequest
from replaylm.server.engine_loop import EngineLoop
from replaylm.server.protocol import APIError

log = logging.getLogger(__name__)


def parse_lora_modules(values: list[str] | None) -> dict[str, str]:
    """``--lora-modules name=path ...`` as ``{name: path}``; ``ValueError`` naming a bad
    entry."""
    modules: dict[str, str] = {}
    for value in values or []:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules entry {value!r} must be NAME=PATH")
        if name in modules:
            raise ValueError(f"--lora-modules names {name!r} twice")
        modules[name] = path
    return modules


class ServedAdapters:
    """The adapters the server serves, by name; ids are given in order from 1."""

    def __init__(self) -> None:
        self.by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def new(self, name: str, path: str) -> LoRARequest:
        if name in self.by_name:
            raise ValueError(f"the LoRA adapter {name!r} has already been loaded")
        return LoRARequest(name, next(self._ids), path)

    def add_at_start(self, core: Engine, modules: dict[str, str]) -> None:
        """Load ``modules`` (``--lora-modules``) before the engine loop starts."""
        for name, path in modules.items():
            request = self.new(name, path)
            core.add_lora(request)
            self.by_name[name] = request
            log.info("serving LoRA adapter %r from %s", name, path)

    def model_cards(self, base: str) -> list[dict[str, Any]]:
        return [{"id": name, "object": "model", "created": 0, "owned_by": "replaylm",
                 "parent": base, "root": r.lora_path} for name, r in self.by_name.items()]


def add_lora_routes(app: FastAPI, engine: EngineLoop, adapters: ServedAdapters,
                    api_key: str | None) -> None:
    """Register the load/unload routes (``api_key``: required as a bearer token)."""
    expected = f"Bearer {api_key}".encode() if api_key else None

    async def fields(request: HTTPRequest, need_path: bool) -> tuple[str, str]:
        if expected is not None:
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                raise APIError("invalid or missing admin API key (Authorization: Bearer "
                               "KEY)", status=401, type_="authentication_error",
                               headers={"WWW-Authenticate": "Bearer"})
        try:
            body = json.loads(await request.body() or b"{}")
        except ValueError as e:
            raise APIError(f"the request body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise APIError("the request body must be a JSON object")
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name:
            raise APIError("lora_name must be a non-empty string", param="lora_name")
        if need_path and (not isinstance(path, str) or not path):
            raise APIError("lora_path must be a directory on the server", param="lora_path")
        return name, path or ""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: HTTPRequest) -> dict:
        name, path = await fields(request, need_path=True)
        try:
            lora = adapters.new(name, path)
            await engine.call(lambda core: core.add_lora(lora))
        except ValueError as e:
            raise APIError(str(e), param="lora_path") from None
        if name in adapters.by_name:  # a concurrent load of the same name won
            raise APIError(f"the LoRA adapter {name!r} has already been loaded",
                           param="lora_name")
        adapters.by_name[name] = lora
        log.info("serving LoRA adapter %r from %s", name, path)
        return {"message": f"Success: LoRA adapter {name!r} added successfully.",
                "lora_name": name, "lora_int_id": lora.lora_int_id}

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: HTTPRequest) -> dict:
        name, _ = await fields(request, need_path=False)
        if adapters.by_name.pop(name, None) is None:
            raise APIError(f"the LoRA adapter {name!r} cannot be found", param="lora_name",
                           status=404, code="model_not_found")
        await engine.call(lambda core: core.remove_lora(name))
        log.info("LoRA adapter %r unloaded", name)
        return {"message": f"Success: LoRA adapter {name!r} removed successfully.",
                "lora_name": name}
