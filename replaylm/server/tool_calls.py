"""Tool calls on ``/v1/chat/completions``: the parsers that find calls in a model's output,
the grammar that forces them, and their streaming.

A parser (``--tool-call-parser``, vLLM's names) knows one output format:

- ``hermes`` (Hermes, Qwen 2.5/3): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
  calls one per line, after optional text;
- ``llama3_json`` (Llama 3.1-3.3): ``{"name": ..., "parameters": {...}}``, calls separated by
  ``"; "``, optionally behind ``<|python_tag|>``, and nothing else in the output.

``tool_choice="required"`` and a named function are enforced by an xgrammar structural tag
(``tool_grammar``): the calls in the parser's format with each function's arguments constrained
by its parameter schema, one or (with ``parallel_tool_calls``) several calls and no other
text, so the output always parses and validates. Structural tags are xgrammar's construct for
exactly this (literal text around JSON-schema parts, tags repeated with a separator); an EBNF
written here would duplicate what xgrammar builds from the schema. ``"auto"`` leaves the
output free and parses what the model wrote: plain content when it is not a call.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

#: The parsers ``--tool-call-parser`` accepts.
PARSERS = ("hermes", "llama3_json")
#: The format ``"required"`` and named-function requests use when no parser is set.
DEFAULT_PARSER = "hermes"


@dataclass(frozen=True)
class ToolCallFormat:
    """Where a call starts and ends, what separates calls and what names the arguments."""

    begin: str
    end: str
    separator: str
    arguments_key: str


FORMATS = {
    "hermes": ToolCallFormat("<tool_call>\n", "\n</tool_call>", "\n", "arguments"),
    "llama3_json": ToolCallFormat("", "", "; ", "parameters"),
}
_PYTHON_TAG = "<|python_tag|>"


@dataclass
class ToolCall:
    """One parsed call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Parsed:
    """A model output split into its text before any call and its calls."""

    content: str | None
    calls: list[ToolCall]


def tool_grammar(tools: list[dict[str, Any]], parser: str, parallel: bool) -> dict[str, Any]:
    """An xgrammar structural tag (its JSON value) whose language is one call (several with
    ``parallel``) of ``tools`` (OpenAI ``{"type": "function", "function": {...}}`` entries)
    in ``parser``'s format, and nothing else."""
    fmt = FORMATS[parser]
    tags = []
    for tool in tools:
        fn = tool["function"]
        params = fn.get("parameters") or {"type": "object"}
        begin = (fmt.begin + '{"name": ' + json.dumps(fn["name"], ensure_ascii=False)
                 + f', "{fmt.arguments_key}": ')
        tags.append({"type": "tag", "begin": begin,
                     "content": {"type": "json_schema", "json_schema": params},
                     "end": "}" + fmt.end})
    return {"type": "structural_tag",
            "format": {"type": "tags_with_separator", "tags": tags,
                       "separator": fmt.separator, "at_least_one": True,
                       "stop_after_first": not parallel}}


def _call(obj: Any, names: set[str], key: str) -> ToolCall | None:
    """A call from a decoded JSON object, if it is one of a known function. Outputs are read
    with ``strict=False``: a raw control character inside a string (which xgrammar lets
    through strings with a ``maxLength``) is kept, and the arguments re-encoded as valid JSON
    text."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get(key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args, strict=False)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def parse_hermes(text: str, names: set[str]) -> Parsed:
    """Calls in ``<tool_call>...</tool_call>`` blocks (the last may lack its end); the text
    before the first block is the content. No block that parses: all of it is content."""
    start = text.find("<tool_call>")
    if start < 0:
        return Parsed(text or None, [])
    calls = []
    for block in text[start:].split("<tool_call>")[1:]:
        body = block.split("</tool_call>", 1)[0].strip()
        try:
            call = _call(json.loads(body, strict=False), names, "arguments")
        except json.JSONDecodeError:
            call = None
        if call is not None:
            calls.append(call)
    if not calls:
        return Parsed(text or None, [])
    content = text[:start].strip()
    return Parsed(content or None, calls)


def parse_llama3_json(text: str, names: set[str]) -> Parsed:
    """Calls as JSON objects separated by ``;`` making up the whole output (after an optional
    ``<|python_tag|>``); anything else is content."""
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG):].lstrip()
    if not body.startswith("{"):
        return Parsed(text or None, [])
    decoder = json.JSONDecoder(strict=False)
    calls, pos = [], 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except json.JSONDecodeError:
            return Parsed(text or None, [])
        call = _call(obj, names, "parameters")
        if call is None:
            return Parsed(text or None, [])
        calls.append(call)
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    return Parsed(None, calls)


def parse(parser: str, text: str, names: set[str]) -> Parsed:
    """``text`` split by ``parser`` into content and calls of the functions ``names``."""
    return (parse_hermes if parser == "hermes" else parse_llama3_json)(text, names)


def _held_from(parser: str, text: str) -> int:
    """Where in ``text`` a call may have begun: text before it is content for sure."""
    if parser == "llama3_json":
        lead = text.lstrip()
        if not lead or lead[0] == "{" or _PYTHON_TAG.startswith(lead[: len(_PYTHON_TAG)]):
            return 0  # the output may be calls: nothing is surely content yet
        return len(text)
    marker = "<tool_call>"
    at = text.find(marker)
    if at >= 0:
        return at
    for k in range(min(len(marker) - 1, len(text)), 0, -1):  # a marker still arriving
        if text.endswith(marker[:k]):
            return len(text) - k
    return len(text)


class ToolCallStream:
    """Streams one choice's output as OpenAI streams tool calls: text that surely is content
    goes out as it comes; from where a call may begin, text is held back; each call goes out
    as one ``tool_calls`` delta once complete (at a hermes block's end, else at the finish);
    held text that turns out not to be calls goes out as content at the finish."""

    def __init__(self, parser: str, names: set[str]) -> None:
        self.parser = parser
        self.names = names
        self.text = ""
        self._sent = 0  # characters of text sent as content
        self.calls: list[ToolCall] = []

    def push(self, new_text: str, finished: bool) -> tuple[str, list[dict[str, Any]]]:
        """The content to send now and the new calls' deltas (``index``, ``id``, ``type``,
        ``function``)."""
        self.text += new_text
        rest = self.text[self._sent:]
        at = _held_from(self.parser, rest)
        content, rest = rest[:at], rest[at:]
        self._sent += at
        if not finished:
            end = rest.rfind("</tool_call>") if self.parser == "hermes" else -1
            rest = rest[: end + len("</tool_call>")] if end >= 0 else ""
        fresh: list[ToolCall] = []
        if rest:
            parsed = parse(self.parser, rest, self.names)
            fresh = parsed.calls[len(self.calls):]
            if finished and not parsed.calls:  # held text that was no call after all
                content += rest
                self._sent = len(self.text)
        deltas = []
        for call in fresh:
            deltas.append({"index": len(self.calls), **call.as_dict()})
            self.calls.append(call)
        return content, deltas
