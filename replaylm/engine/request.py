"""A request as the scheduler sees it: plain data with derived lengths."""

from __future__ import annotations

import enum

from replaylm.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    """A request's state. ``finished`` and ``finish_reason`` are plain attributes of each
    member, set below: the hot path reads them per request per step, and an enum property
    costs ten times an attribute read."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, to be recomputed from scratch
    FINISHED_STOPPED = "stop"  # EOS or a stop token
    FINISHED_LENGTH = "length"  # max_tokens or max_model_len
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # something about this request failed; the others ran on

    finished: bool
    finish_reason: str | None


for _status in RequestStatus:
    _status.finished = _status.name.startswith("FINISHED_")
    _status.finish_reason = _status.value if _status.finished else None


class Request:
    """One generation request.

    ``all_token_ids`` is the prompt followed by the output. ``num_computed_tokens`` counts the
    leading tokens whose K/V are already in the cache; the scheduler advances it. ``block_ids``
    are the paged-KV blocks held, in order; ``slot`` is the request's row in the engine's
    persistent per-request device state (sampling tensors, last sampled token), held while
    running.

    With overlap scheduling a step is launched before the previous one's samples reach the
    host. Such a sample is *pending*: it counts in ``num_tokens`` (the scheduler plans the next
    step around it, and the step reads it from the device), but not in ``output_token_ids``
    until the step that made it is resolved. ``inflight`` counts launched, unresolved steps that
    use this request: its blocks and slot are not released while it is above zero.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival: int,
        seed: int,
        eos_token_ids: tuple[int, ...] = (),
        max_tokens: int = 16,
        prompt: str | None = None,
        parent_id: str | None = None,
        index: int = 0,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.sampling_params = sampling_params
        self.arrival = arrival
        self.seed = seed
        self.eos_token_ids = eos_token_ids
        self.max_tokens = max_tokens
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        self.slot: int = -1
        # The slot whose ``last_token`` device entry holds this request's newest output token
        # (-1: none does, e.g. after a preemption); only then may a step read it from there.
        self.device_token_slot: int = -1
        # Leading block ids already written to the device block table of ``slot``.
        self.table_len = 0
        self.num_pending = 0  # sampled by launched steps, not yet on the host
        self.inflight = 0  # launched steps using this request that are not resolved yet
        self.num_preemptions = 0
        # n > 1: siblings share ``parent_id`` (the caller's id) and differ in ``index``; a
        # sibling waits for ``leader`` (index 0) to compute the prompt, then shares its blocks.
        self.parent_id = parent_id if parent_id is not None else request_id
        self.index = index
        self.leader: Request | None = None
        # Prompt logprobs are computed once per parent, by sibling 0.
        self.prompt_logprobs_k: int | None = (
            sampling_params.prompt_logprobs if index == 0 else None
        )
        self.prompt_logprobs: list = []  # TokenLogprobs of prompt tokens 1.., as computed
        self.output_logprobs: list = []  # TokenLogprobs per output token (if requested)
        # Prefix caching: hashes of the request's full blocks registered so far (chain order).
        self.block_hashes: list[tuple[int, int]] = []  # (chain hash, cache entry serial)
        self.stop_reason: int | str | None = None  # the stop token or string that ended it
        self.error: str | None = None  # why it finished with FINISHED_ERROR
        # Speculative decoding: the drafter's proposal for the next step (the scheduler
        # verifies what fits); empty when speculation is off or nothing was proposed.
        self.draft_tokens: list[int] = []
        # Structured outputs: the xgrammar matcher of this request's grammar (None: free text),
        # advanced by every accepted token (``replaylm.structured.masks``).
        self.grammar = None
        # LoRA: the adapter's id (0: the base model) and, while running, its device slot.
        self.lora_int_id = 0
        self.lora_slot = -1

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Output tokens known on the host."""
        return len(self.output_token_ids)

    @property
    def num_generated(self) -> int:
        """Output tokens sampled so far, pending ones included: the next sample's index."""
        return len(self.output_token_ids) + self.num_pending

    @property
    def num_known_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt + output tokens, pending samples included."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, i: int) -> int:
        p = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < p else self.output_token_ids[i - p]

    def token_slice(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` without building the whole list (a per-step hot path:
        a decode step of a long request needs one token, not a copy of all of them).

        Pending positions (past the known tokens) read as 0: a step takes them from the
        device, where the sampler left them.
        """
        p = len(self.prompt_token_ids)
        known = p + len(self.output_token_ids)
        if end > known:
            if start >= known:  # a decode step's input is the pending sample itself
                return [0] * (end - start)
            return self.token_slice(start, known) + [0] * (end - known)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}, "
            f"out={self.num_output_tokens}+{self.num_pending}, computed={self.num_computed_tokens}, "
            f"blocks={len(self.block_ids)}, slot={self.slot})"
        )
