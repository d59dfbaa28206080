"""OpenAI response shapes: completion and chat objects, stream chunks, usage, logprobs."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(obj: dict[str, Any] | str) -> str:
    """One server-sent event; ``[DONE]`` goes out verbatim."""
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n"


def _entry(e: Any) -> tuple[int | None, float, dict[int, float]]:
    """(token id, logprob, top alternatives) of one engine logprob entry.

    Accepts the engine's ``TokenLogprobs`` (``token_id``/``logprob``/``top``) and, defensively,
    vLLM's ``{token_id: Logprob | float}`` dicts (whose first key is the sampled token).
    """
    if hasattr(e, "logprob"):
        top = {int(k): float(getattr(v, "logprob", v)) for k, v in dict(e.top or {}).items()}
        return getattr(e, "token_id", None), float(e.logprob), top
    items = {int(k): float(getattr(v, "logprob", v)) for k, v in dict(e).items()}
    first = next(iter(items), None)
    return first, items.get(first, float("nan")), items


@dataclass
class LogprobFormatter:
    """Turns per-token engine entries into either endpoint's ``logprobs`` object."""

    tokenizer: Any
    chat: bool
    top_k: int

    def _text(self, token_id: int | None) -> str:
        if token_id is None or self.tokenizer is None:
            return "" if token_id is None else f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def format(self, token_ids: list[int], entries: list[Any] | None,
               text_offset: int = 0) -> dict[str, Any] | None:
        if entries is None:
            return None
        if self.chat:
            return {"content": [self._chat_item(t, e) for t, e in zip(token_ids, entries)
                                if e is not None]}
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                               "text_offset": []}
        for t, e in zip(token_ids, entries):
            if e is None:
                continue
            tid, lp, top = _entry(e)
            text = self._text(t if tid is None else tid)
            out["tokens"].append(text)
            out["token_logprobs"].append(lp)
            out["top_logprobs"].append(
                {self._text(k): v for k, v in list(top.items())[: self.top_k]})
            out["text_offset"].append(text_offset)
            text_offset += len(text)
        return out

    def format_prompt(self, token_ids: list[int],
                      entries: list[Any] | None) -> dict[str, Any] | None:
        """An echoed prompt's legacy logprobs object: every prompt token, the first with
        ``null`` logprob and alternatives (nothing predicts it), text offsets from 0."""
        if entries is None or self.chat:
            return None
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                               "text_offset": []}
        offset = 0
        for t, e in zip(token_ids, entries):
            text = self._text(t)
            out["tokens"].append(text)
            out["text_offset"].append(offset)
            offset += len(text)
            if e is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            _, lp, top = _entry(e)
            out["token_logprobs"].append(lp)
            out["top_logprobs"].append(
                {self._text(k): v for k, v in list(top.items())[: self.top_k]})
        return out

    def _chat_item(self, token_id: int, e: Any) -> dict[str, Any]:
        tid, lp, top = _entry(e)
        text = self._text(token_id if tid is None else tid)
        return {"token": text, "logprob": lp, "bytes": list(text.encode()),
                "top_logprobs": [{"token": (s := self._text(k)), "logprob": v,
                                  "bytes": list(s.encode())}
                                 for k, v in list(top.items())[: self.top_k]]}


def merge_logprobs(acc: dict[str, Any] | None, new: dict[str, Any] | None) -> dict[str, Any] | None:
    """Append one delta's logprobs object to a choice's running one (non-streaming answers)."""
    if new is None:
        return acc
    if acc is None:
        return new
    for key, values in new.items():
        acc[key].extend(values)
    return acc


@dataclass
class Shapes:
    """The envelope shared by every object of one response."""

    response_id: str
    created: int
    model: str
    chat: bool

    def chunk(self, index: int, text: str | None, finish_reason: str | None,
              logprobs: dict[str, Any] | None = None, role: bool = False,
              tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice = {"index": index, "delta": delta, "logprobs": logprobs,
                      "finish_reason": finish_reason}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs,
                      "finish_reason": finish_reason}
            obj = "text_completion"
        return {"id": self.response_id, "object": obj, "created": self.created,
                "model": self.model, "choices": [choice], "usage": None}

    def usage_chunk(self, u: dict[str, int]) -> dict[str, Any]:
        return {"id": self.response_id,
                "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [], "usage": u}

    def final(self, choices: list[ChoiceState], u: dict[str, int]) -> dict[str, Any]:
        if self.chat:
            out = [{"index": i, "message": _message(c), "logprobs": c.logprobs,
                    "finish_reason": c.finish_reason} for i, c in enumerate(choices)]
            obj = "chat.completion"
        else:
            out = [{"index": i, "text": c.text, "logprobs": c.logprobs,
                    "finish_reason": c.finish_reason} for i, c in enumerate(choices)]
            obj = "text_completion"
        return {"id": self.response_id, "object": obj, "created": self.created,
                "model": self.model, "choices": out, "usage": u}


def _message(c: ChoiceState) -> dict[str, Any]:
    if c.tool_calls is None:
        return {"role": "assistant", "content": c.text}
    return {"role": "assistant", "content": c.text or None, "tool_calls": c.tool_calls}


@dataclass
class Echo:
    """A completion prompt to echo: its text (as sent, or its ids decoded) and its ids."""

    text: str
    token_ids: list[int]


@dataclass
class ChoiceState:
    """One choice's text so far (non-streaming answers, and logprob text offsets)."""

    text: str = ""
    started: bool = False
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: dict[str, Any] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # parsed calls (chat with tools)
