"""Per-request sampling settings, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Penalties are kept in vLLM's accepted ranges: beyond them the distribution degenerates.
MAX_ABS_PRESENCE_FREQUENCY = 2.0


@dataclass
class SamplingParams:
    """How to sample one request's output (vLLM-compatible names).

    ``temperature=0`` is greedy. ``top_k=-1`` (or 0) and ``top_p=1`` disable those filters.
    ``seed`` makes a request's samples reproducible whatever batch it lands in; with ``n > 1``
    sibling ``i`` samples from a stream derived from ``(seed, i)`` (sibling 0 uses ``seed``).

    Logit processing (all neutral by default, and then skipped entirely):
    ``presence_penalty`` / ``frequency_penalty`` follow OpenAI (subtracted once per seen output
    token / once per occurrence), ``repetition_penalty`` follows HF/vLLM (over prompt and output
    tokens: positive logits divided, negative multiplied), ``min_p`` keeps tokens whose
    probability is at least ``min_p`` times the top one's (after temperature), ``logit_bias``
    adds to chosen token ids' logits, and ``min_tokens`` masks EOS and ``stop_token_ids`` until
    that many tokens have been generated (stop strings are ignored until then too).

    ``stop`` strings end the output when they appear in the text; the stop string itself is
    dropped unless ``include_stop_str_in_output``. ``logprobs=k`` returns, per generated token,
    its logprob and the top-``k`` alternatives; ``prompt_logprobs=k`` does the same for every
    prompt token after the first. Logprobs are of the raw model distribution (before penalties
    and temperature), like vLLM's default.
    """

    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    include_stop_str_in_output: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        _check(isinstance(self.n, int) and self.n >= 1, "n", self.n, "must be an integer >= 1")
        _check(
            self.best_of is None or self.best_of == self.n, "best_of", self.best_of,
            "must be None or equal to n (ranking best_of > n candidates is not supported)",
        )
        _check(self.temperature >= 0.0, "temperature", self.temperature, "must be >= 0")
        _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "must be in (0, 1]")
        _check(self.top_k == -1 or self.top_k >= 0, "top_k", self.top_k, "must be -1 (off) or >= 0")
        _check(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "must be in [0, 1]")
        _check(
            self.max_tokens is None or self.max_tokens >= 1,
            "max_tokens", self.max_tokens, "must be >= 1 (or None for up to max_model_len)",
        )
        _check(
            isinstance(self.min_tokens, int) and self.min_tokens >= 0,
            "min_tokens", self.min_tokens, "must be an integer >= 0",
        )
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens", self.min_tokens, f"must be <= max_tokens ({self.max_tokens})",
        )
        _check(
            self.seed is None or 0 <= self.seed < 2**63,
            "seed", self.seed, "must be in [0, 2**63)",
        )
        self.stop_token_ids = list(self.stop_token_ids)
        for t in self.stop_token_ids:
            _check(isinstance(t, int) and t >= 0, "stop_token_ids", t, "must be non-negative ints")
        if self.top_k == 0:
            self.top_k = -1
        self._check_stop()
        self._check_penalties()
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            _check(v is None or (isinstance(v, int) and v >= 0), name, v,
                   "must be None or an integer >= 0")

    def _check_stop(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        for s in self.stop:
            _check(isinstance(s, str) and s != "", "stop", s, "must be non-empty strings")

    def _check_penalties(self) -> None:
        lim = MAX_ABS_PRESENCE_FREQUENCY
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _check(math.isfinite(v) and -lim <= v <= lim, name, v, f"must be in [-{lim}, {lim}]")
        _check(
            math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0,
            "repetition_penalty", self.repetition_penalty, "must be > 0 (1 is off)",
        )
        if self.logit_bias is not None:
            bias = {}
            for k, v in dict(self.logit_bias).items():
                # JSON clients send ids as strings: accept "42" like OpenAI does.
                tid = int(k) if isinstance(k, str) and k.lstrip("-").isdigit() else k
                _check(isinstance(tid, int) and tid >= 0, "logit_bias", k,
                       "keys must be non-negative token ids")
                _check(isinstance(v, int | float) and -100.0 <= v <= 100.0, "logit_bias", v,
                       "values must be in [-100, 100]")
                bias[tid] = float(v)
            self.logit_bias = bias or None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        """Whether presence/frequency/repetition penalties change anything."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def uses_logits_processing(self) -> bool:
        """Whether any logit processing beyond temperature/top-k/top-p is requested."""
        return (
            self.uses_penalties or self.min_p > 0.0 or bool(self.logit_bias)
            or self.min_tokens > 0
        )


def _check(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name}={value!r} is invalid: {rule}")
