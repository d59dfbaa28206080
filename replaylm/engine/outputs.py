"""What the engine hands back: per-step deltas and finished outputs (vLLM's shapes)."""

from __future__ import annotations

from dataclasses import dataclass, field

from replaylm.sampling.logprobs import TokenLogprobs


@dataclass
class RequestDelta:
    """What one ``step()`` produced for one request (one sibling, with ``n > 1``), to stream.

    - ``request_id``: the id given to ``add_request``; with ``n > 1`` every sibling reports
      under it, told apart by ``index`` (0 .. n-1).
    - ``new_token_ids``: tokens generated this step (usually one).
    - ``new_text``: text that became final this step. Text is held back while it may still be
      part of a stop string or an incomplete UTF-8 character; a matched stop string is never
      included (unless ``include_stop_str_in_output``).
    - ``finished`` / ``finish_reason`` (``"stop"``, ``"length"``, ``"abort"``, ``"error"``) /
      ``stop_reason`` (the stop string or stop token id that ended it; ``None`` for EOS or
      other reasons) / ``error`` (with ``"error"``: what failed for this request alone). A
      finished request's blocks are freed when the delta is returned, or, with overlap
      scheduling, when the step already launched for it resolves (the next ``step()``).
    - ``logprobs``: with ``SamplingParams.logprobs``, one ``TokenLogprobs`` per new token
      (``token_id``, ``logprob``, ``rank``, ``top`` = {token id: logprob} of the top-k).
    - ``prompt_logprobs``: with ``SamplingParams.prompt_logprobs``, on the sibling-0 delta that
      carries the first token: ``None`` for the first prompt token, then one ``TokenLogprobs``
      per prompt token.
    - ``num_prompt_tokens``: prompt length (for usage accounting).
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_prompt_tokens: int = 0
    index: int = 0
    error: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None
    error: str | None = None  # with finish_reason "error": what failed


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    prompt_logprobs: list[TokenLogprobs | None] | None = None
