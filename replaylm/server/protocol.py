"""Request bodies of the OpenAI API (pydantic), their errors, and the mapping to ``SamplingParams``.

Bodies are parsed strictly (a string where a number belongs is an error, as with OpenAI; so
is a number that is not finite, such as ``1e999`` or ``Infinity``) and every failure becomes
an :class:`APIError` that names the offending field in ``param``. Range checks live in
``SamplingParams`` alone, whose ``ValueError`` messages name the field too, so the server and
``LLM`` accept exactly the same values; a field the client sent under another name
(``max_completion_tokens``) is named as sent.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from replaylm.sampling_params import (
    STRUCTURED_KINDS,
    SamplingParams,
    StructuredOutputsParams,
    sibling_seed,
)

MAX_N = 16  # choices per request: more is almost surely a client bug, and each costs a slot
MAX_TOP_LOGPROBS = 20  # OpenAI's limit

# Fields the engine gained (or will gain) over time; None/neutral values are never sent, so an
# engine without the field still serves every request that does not use it.
_NEUTRAL: dict[str, Any] = {
    "stop": [], "include_stop_str_in_output": False, "presence_penalty": 0.0,
    "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_p": 0.0, "logit_bias": {},
    "min_tokens": 0, "logprobs": None,
}


class APIError(Exception):
    """An error answered as OpenAI's JSON: ``{"error": {message, type, param, code}}``."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type_: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status = message, param, status
        self.type, self.code, self.headers = type_, code, headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def from_validation_error(err: ValidationError) -> APIError:
    """The first pydantic error, with ``param`` = the top-level field it concerns."""
    first = err.errors(include_url=False)[0]
    loc = [str(p) for p in first.get("loc", ())]
    if first["type"] == "json_invalid":
        return APIError(f"request body is not valid JSON: {first['msg']}", code="invalid_json")
    if not loc:
        return APIError(f"request body is invalid: {first['msg']}")
    return APIError(f"{'.'.join(loc)}: {first['msg']}", param=loc[0])


_SP_FIELD = re.compile(r"^SamplingParams\.(\w+)=")


def from_value_error(err: ValueError, prompt_param: str = "prompt",
                     structured_param: str | None = None) -> APIError:
    """Map the engine's ``ValueError`` (its message names the field) to a 400;
    ``structured_param``: the body field a structured-output spec came from."""
    msg = str(err)
    if msg.startswith("SamplingParams.structured_outputs"):
        return APIError(msg, param=structured_param or "structured_outputs")
    m = _SP_FIELD.search(msg)
    if m:
        return APIError(msg, param=m.group(1))
    # EngineCore.validate / tokenize phrase prompt problems as "prompt ..." (possibly behind
    # LLM's "prompt i:" prefix); for chat the prompt is built from ``messages``.
    if re.match(r"^(prompt|this engine has no tokenizer)", msg):
        return APIError(msg, param=prompt_param)
    return APIError(msg)


def engine_supports(name: str) -> bool:
    """Whether this build's ``SamplingParams`` has field ``name``."""
    return name in {f.name for f in dataclasses.fields(SamplingParams)}


#: Strict types, unknown fields ignored, non-finite numbers refused.
_STRICT = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class _SamplingBody(BaseModel):
    """Fields shared by both endpoints; ``top_k``, ``ignore_eos``, ``stop_token_ids``, ``min_p``,
    ``min_tokens``, ``repetition_penalty``, ``skip_special_tokens`` and
    ``include_stop_str_in_output`` are vLLM-style extensions."""

    model_config = _STRICT

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs extension and
    # its older guided_* fields (``structured_params``).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingBody):
    """``POST /v1/completions``; ``prompt`` may be text, token ids, or a list of either.

    ``echo`` prepends each prompt to its choices' text and, with ``logprobs``, the prompt
    tokens' logprobs (the first ``null``) to the completion's; ``max_tokens=0`` with ``echo``
    scores the prompt alone (``score_only``): what evaluation harnesses send for
    loglikelihoods.
    """

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = None

    @property
    def score_only(self) -> bool:
        """Echo the prompt and generate nothing (``echo`` with ``max_tokens=0``)."""
        return self.echo and self.max_tokens == 0

    @property
    def prompt_logprobs(self) -> int | None:
        """The prompt logprobs an echo with ``logprobs`` needs (their top-k), else None."""
        return self.logprobs if self.echo else None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            out: list[str | list[int]] = [p]
        elif p and all(isinstance(t, int) for t in p):
            out = [list(p)]  # type: ignore[arg-type]
        else:
            out = list(p)  # type: ignore[arg-type]
        if not out or any(len(x) == 0 for x in out):
            raise APIError("prompt is empty: a request needs at least one prompt token",
                           param="prompt")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError("best_of must equal n (ranking candidates is not supported)",
                           param="best_of")
        return out


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def as_template_dict(self) -> dict[str, Any]:
        """The message as chat templates read it: text content, and a call's ``arguments``
        as an object (templates print them with ``tojson``; OpenAI sends JSON text)."""
        c = self.content
        text = c if isinstance(c, str) else "".join(p.text for p in c or [])
        out: dict[str, Any] = {"role": self.role, "content": text}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            calls = []
            for call in self.tool_calls:
                fn = dict(call.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except json.JSONDecodeError as e:
                        raise APIError(f"messages: a tool call's function.arguments is not "
                                       f"JSON: {e}", param="messages") from e
                calls.append({**call, "function": fn})
            out["tool_calls"] = calls
        return out


class FunctionDefinition(BaseModel):
    model_config = _STRICT
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = _STRICT
    name: str


class NamedToolChoice(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_SamplingBody):
    """``POST /v1/chat/completions``; ``tools``, ``tool_choice`` and ``parallel_tool_calls``
    as OpenAI's (``server.tool_calls``)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as chat templates take them (OpenAI's shape), or None."""
        if not self.tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]


def native_n_supported() -> bool:
    """Whether the engine runs ``n > 1`` siblings itself (deltas tell them apart by ``index``)."""
    from replaylm.engine.outputs import RequestDelta

    if "index" not in {f.name for f in dataclasses.fields(RequestDelta)}:
        return False
    try:
        SamplingParams(n=2)
    except ValueError:
        return False
    return True


def sampling_params(body: CompletionRequest | ChatCompletionRequest, sibling: int = 0,
                    logprob_support: bool = True, n: int = 1,
                    tool_constraint: StructuredOutputsParams | None = None) -> SamplingParams:
    """The engine's params for ``body``: all ``n`` choices at once (``n > 1``, engine-run
    siblings), or choice ``sibling`` alone (``n == 1``, the server fans choices out).

    ``tool_constraint``: the grammar forcing the request's tool calls (``server.tool_plan``),
    which takes the place of any other structured-output constraint.

    Raises :class:`APIError` for a feature this engine build lacks and ``ValueError`` (from
    ``SamplingParams``) for a value out of range.
    """
    kw: dict[str, Any] = {"n": n, "ignore_eos": body.ignore_eos,
                          "skip_special_tokens": body.skip_special_tokens}
    for name in ("temperature", "top_p", "top_k"):
        if getattr(body, name) is not None:
            kw[name] = getattr(body, name)
    max_tokens_field = "max_tokens"
    if isinstance(body, ChatCompletionRequest):
        kw["max_tokens"] = body.max_tokens
        if body.max_completion_tokens is not None:  # OpenAI's name; 0 is a value, not "unset"
            if body.max_tokens is not None:
                SamplingParams(max_tokens=body.max_tokens)  # both are checked, each by its name
            kw["max_tokens"] = body.max_completion_tokens
            max_tokens_field = "max_completion_tokens"
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
    else:
        # Scoring a prompt samples one token (the engine runs a request to its first sample,
        # which also delivers the prompt logprobs) that the answer leaves out, as vLLM does.
        kw["max_tokens"] = 1 if body.score_only else body.max_tokens
        logprobs = body.logprobs
        if body.prompt_logprobs is not None:
            if not engine_supports("prompt_logprobs"):
                raise APIError("echo with logprobs is not supported by this engine build",
                               param="echo")
            kw["prompt_logprobs"] = body.prompt_logprobs
    if body.stop_token_ids:
        kw["stop_token_ids"] = body.stop_token_ids
    if body.seed is not None:
        # Sibling 0 keeps the seed (n=1 answers as LLM.generate does); others get distinct
        # streams, or n seeded choices would all be the same text.
        kw["seed"] = sibling_seed(body.seed, sibling)
    optional = {
        "stop": [body.stop] if isinstance(body.stop, str) else body.stop,
        "include_stop_str_in_output": body.include_stop_str_in_output,
        "presence_penalty": body.presence_penalty, "frequency_penalty": body.frequency_penalty,
        "repetition_penalty": body.repetition_penalty, "min_p": body.min_p,
        "logit_bias": body.logit_bias, "min_tokens": body.min_tokens, "logprobs": logprobs,
    }
    for name, value in optional.items():
        if value is None or (value == _NEUTRAL[name] and name != "logprobs"):
            continue
        if not engine_supports(name) or (name == "logprobs" and not logprob_support):
            raise APIError(f"{name} is not supported by this engine build yet", param=name)
        kw[name] = value
    so, source = structured_params(body)
    if tool_constraint is not None:
        so = tool_constraint
    if so is not None:
        kw["structured_outputs"] = so
    try:
        return SamplingParams(**kw)
    except ValueError as e:
        prefix = "SamplingParams.max_tokens="
        if max_tokens_field != "max_tokens" and str(e).startswith(prefix):
            raise APIError(f"{max_tokens_field}={str(e)[len(prefix):]}",
                           param=max_tokens_field) from e
        raise


_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


def structured_params(body: _SamplingBody) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's structured-output spec and the body field it came from: at most one of
    ``response_format`` (``json_object``, ``json_schema``; ``text`` is none),
    ``structured_outputs`` ({json|regex|choice|grammar|json_object}) and ``guided_*``. A bad
    one is an :class:`APIError` naming the field."""
    found: list[tuple[str, dict[str, Any]]] = []
    rf = body.response_format
    if rf is not None:
        kind = rf.get("type")
        if kind == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif kind == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict | bool):
                raise APIError("response_format.json_schema must be an object with a 'name' and "
                               "a 'schema' (a JSON schema object)", param="response_format")
            schema = js.get("schema", {})  # OpenAI: no schema means any JSON object
            found.append(("response_format",
                          {"json": schema if schema not in ({}, True) else {"type": "object"}}))
        elif kind != "text":
            raise APIError(f"response_format.type={kind!r} is invalid: must be text, "
                           "json_object or json_schema", param="response_format")
    if body.structured_outputs is not None:
        unknown = sorted(set(body.structured_outputs) - set(STRUCTURED_KINDS))
        if unknown:
            raise APIError(f"structured_outputs.{unknown[0]} is not supported: give one of "
                           f"{', '.join(STRUCTURED_KINDS)}", param="structured_outputs")
        found.append(("structured_outputs", dict(body.structured_outputs)))
    for name, kind in _GUIDED.items():
        value = getattr(body, name)
        if value is not None:
            found.append((name, {kind: value}))
    if not found:
        return None, None
    if len(found) > 1:
        raise APIError(f"{found[1][0]} cannot be combined with {found[0][0]}: give one "
                       "structured-output constraint", param=found[1][0])
    source, fields = found[0]
    try:
        return StructuredOutputsParams(**fields), source
    except ValueError as e:
        raise APIError(str(e), param=source) from e

