"""Per-request sampling settings, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How to sample one request's output (vLLM-compatible names).

    ``temperature=0`` is greedy. ``top_k=-1`` (or 0) and ``top_p=1`` disable those filters.
    ``seed`` makes a request's samples reproducible whatever batch it lands in.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int | None = 16
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        _check(self.n == 1, "n", self.n, "must be 1 (n > 1 is not supported yet)")
        _check(self.temperature >= 0.0, "temperature", self.temperature, "must be >= 0")
        _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "must be in (0, 1]")
        _check(self.top_k == -1 or self.top_k >= 0, "top_k", self.top_k, "must be -1 (off) or >= 0")
        _check(
            self.max_tokens is None or self.max_tokens >= 1,
            "max_tokens", self.max_tokens, "must be >= 1 (or None for up to max_model_len)",
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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _check(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name}={value!r} is invalid: {rule}")
