"""How a chat request uses its tools (``tools``, ``tool_choice``, ``parallel_tool_calls``):
which parser reads its output and which grammar, if any, forces a call."""

from __future__ import annotations

from dataclasses import dataclass

from replaylm.sampling_params import StructuredOutputsParams
from replaylm.server.protocol import (
    APIError,
    ChatCompletionRequest,
    NamedToolChoice,
    structured_params,
)
from replaylm.server.tool_calls import DEFAULT_PARSER, PARSERS, tool_grammar


@dataclass(frozen=True)
class ToolPlan:
    """How a chat request uses its tools: ``parser`` reads calls from the output (None: the
    output is plain content); ``constraint`` forces them (``required`` or a named function);
    ``names``: the functions a call may name."""

    parser: str | None
    constraint: StructuredOutputsParams | None
    names: frozenset[str]


def tool_plan(body: ChatCompletionRequest, parser: str | None) -> ToolPlan:
    """The request's tool handling under the server's ``--tool-call-parser``; an
    :class:`APIError` naming ``tool_choice`` or ``tools`` for a choice that cannot be served."""
    tools = body.tools or []
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice != "none" and not tools:
        raise APIError("tool_choice needs tools: give the functions the model may call",
                       param="tool_choice")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise APIError("tools: function names must be unique", param="tools")
    if choice == "none":
        return ToolPlan(None, None, frozenset())
    if choice == "auto":
        if parser is None:
            raise APIError('tool_choice="auto" needs a server started with --tool-call-parser '
                           f"({' or '.join(PARSERS)}); \"required\" or a named function "
                           "work without one", param="tool_choice")
        return ToolPlan(parser, None, frozenset(names))
    if structured_params(body)[0] is not None:
        raise APIError("tool_choice forcing a call cannot be combined with response_format or "
                       "another structured-output constraint", param="tool_choice")
    if isinstance(choice, NamedToolChoice):
        chosen = [t for t in tools if t.function.name == choice.function.name]
        if not chosen:
            raise APIError(f"tool_choice names function {choice.function.name!r}, which is not "
                           f"in tools ({', '.join(names)})", param="tool_choice")
        tools, parallel = chosen, False
    else:
        parallel = body.parallel_tool_calls
    fmt = parser or DEFAULT_PARSER
    tag = tool_grammar([t.model_dump(exclude_none=True) for t in tools], fmt, parallel)
    return ToolPlan(fmt, StructuredOutputsParams(structural_tag=tag),
                    frozenset(t.function.name for t in tools))
