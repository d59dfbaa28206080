"""What the engine hands back: per-step deltas and finished outputs (vLLM's shapes)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestDelta:
    """What one ``step()`` produced for one request, ready to stream."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
