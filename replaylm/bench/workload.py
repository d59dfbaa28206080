"""Request traces for ``bench serve``: synthetic (lengths from a distribution, Poisson
arrivals) or read from a JSONL file. Everything is drawn from seeded generators, so a run
is the same requests at the same times whatever the machine.

A trace line is a JSON object with ``output_len`` and either ``prompt`` (text or a list of
token ids) or ``prompt_len`` (a random prompt of that many token ids is made), and optionally
``arrival_s`` (seconds from the start; with ``--request-rate`` the arrivals are drawn instead).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np

LEN_DISTS = ("fixed", "uniform", "exponential")


@dataclasses.dataclass(frozen=True)
class RequestSpec:
    """One request of a trace; ``prompt_len`` is None for a text prompt (not tokenized)."""

    index: int
    arrival_s: float
    prompt: str | list[int]
    prompt_len: int | None
    output_len: int


def parse_rates(text: str) -> list[float]:
    """``"1,2,4,inf"`` -> ``[1.0, 2.0, 4.0, inf]``; every rate > 0 (``inf``: all at once)."""
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise ValueError(f"expected comma-separated rates (numbers or inf), got {text!r}") from e
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"request rates must be > 0 (inf: all at once), got {text!r}")
    return rates


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def sample_lengths(n: int, mean: int, dist: str, range_ratio: float,
                   rng: np.random.Generator) -> list[int]:
    """``n`` lengths >= 1 around ``mean``: ``fixed``; ``uniform`` over mean × [1 - r, 1 + r];
    ``exponential`` with that mean (rounded, at least 1)."""
    if mean < 1:
        raise ValueError(f"lengths must be >= 1, got {mean}")
    if dist == "fixed":
        return [mean] * n
    if dist == "uniform":
        lo = max(1, round(mean * (1 - range_ratio)))
        hi = max(lo, round(mean * (1 + range_ratio)))
        return [int(x) for x in rng.integers(lo, hi + 1, size=n)]
    if dist == "exponential":
        return [max(1, round(float(x))) for x in rng.exponential(mean, size=n)]
    raise ValueError(f"unknown length distribution {dist!r}; choose from {list(LEN_DISTS)}")


def poisson_arrivals(n: int, rate: float, rng: np.random.Generator) -> list[float]:
    """Arrival times (s) of a Poisson process at ``rate`` requests/s, the first at 0;
    all 0 for ``inf``."""
    if math.isinf(rate):
        return [0.0] * n
    gaps = rng.exponential(1.0 / rate, size=max(0, n - 1))
    return [0.0, *np.cumsum(gaps).tolist()][:n]


def random_prompt(length: int, vocab_size: int, rng: np.random.Generator) -> list[int]:
    return [int(t) for t in rng.integers(0, vocab_size, size=length)]


def synthetic(n: int, input_len: int, output_len: int, dist: str, range_ratio: float,
              vocab_size: int, seed: int, prompt_seed: int | None = None) -> list[RequestSpec]:
    """``n`` requests with random token-id prompts (all different, so no prefix is shared),
    lengths from ``dist``, all arriving at 0 (see :func:`with_arrivals`). Lengths come from
    ``seed``, prompt tokens from ``prompt_seed`` (default: the same stream), so runs can share
    lengths without sharing prompts."""
    rng = np.random.default_rng(seed)
    ins = sample_lengths(n, input_len, dist, range_ratio, rng)
    outs = sample_lengths(n, output_len, dist, range_ratio, rng)
    tokens = rng if prompt_seed is None else np.random.default_rng(prompt_seed)
    return [RequestSpec(i, 0.0, random_prompt(a, vocab_size, tokens), a, b)
            for i, (a, b) in enumerate(zip(ins, outs))]


def load_trace(path: str | Path, vocab_size: int, seed: int) -> list[RequestSpec]:
    """Read a JSONL trace (see the module docstring); requests sorted by arrival."""
    rng = np.random.default_rng(seed)
    specs = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            d = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{where}: not JSON ({e})") from e
        if not isinstance(d, dict) or "output_len" not in d or not (
                "prompt" in d or "prompt_len" in d):
            raise ValueError(f"{where}: needs output_len and prompt or prompt_len")
        prompt = d.get("prompt")
        if prompt is None:
            prompt = random_prompt(int(d["prompt_len"]), vocab_size, rng)
        if isinstance(prompt, list) and not all(isinstance(t, int) for t in prompt):
            raise ValueError(f"{where}: prompt must be text or a list of token ids")
        length = len(prompt) if isinstance(prompt, list) else None
        if (length is not None and length < 1) or int(d["output_len"]) < 1:
            raise ValueError(f"{where}: prompt and output_len must have at least one token")
        specs.append(RequestSpec(len(specs), float(d.get("arrival_s", 0.0)), prompt, length,
                                 int(d["output_len"])))
    if not specs:
        raise ValueError(f"{path}: no requests")
    specs.sort(key=lambda s: s.arrival_s)
    t0 = specs[0].arrival_s
    return [dataclasses.replace(s, index=i, arrival_s=s.arrival_s - t0)
            for i, s in enumerate(specs)]


def with_arrivals(specs: list[RequestSpec], rate: float, seed: int) -> list[RequestSpec]:
    """The same requests arriving as a Poisson process at ``rate`` (``inf``: all at 0)."""
    times = poisson_arrivals(len(specs), rate, np.random.default_rng(seed + 7919))
    return [dataclasses.replace(s, arrival_s=t) for s, t in zip(specs, times)]


def fit_context(specs: list[RequestSpec], max_model_len: int) -> tuple[list[RequestSpec], int]:
    """Shorten what does not fit ``max_model_len`` (token-id prompts to ``max_model_len - 1``,
    then the output to the room left); returns the requests and how many were shortened."""
    out, clipped = [], 0
    for s in specs:
        prompt, length = s.prompt, s.prompt_len
        if isinstance(prompt, list) and len(prompt) >= max_model_len:
            prompt, length = prompt[: max_model_len - 1], max_model_len - 1
        room = max_model_len - (length or 0)
        output = min(s.output_len, room) if length is not None else s.output_len
        if (prompt, output) != (s.prompt, s.output_len):
            clipped += 1
        out.append(dataclasses.replace(s, prompt=prompt, prompt_len=length, output_len=output))
    return out, clipped
