"""The batched rows of ``bench decode``: N requests at a fixed concurrency, long enough to be
steady, repeated, with every step recorded.

A repeat keeps ``concurrency`` requests in the engine and adds the next as soon as one
finishes (a closed loop, as clients with a fixed number of connections do) until ``requests``
have run. The request count is chosen so that a repeat holds at least ``min_seconds`` of
work (from the warm-up's median step time) unless given. Each repeat's per-step samples
(``bench.observer.StepSample``) say what every step ran and where its time went, so the slow
steps can be attributed (:func:`tail_attribution`).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from replaylm.bench.common import percentile
from replaylm.bench.observer import StepClock, StepSample, observing
from replaylm.sampling_params import SamplingParams

#: A step counts as host-bound when the host work inside ``step()`` is this share of it.
HOST_BOUND_SHARE = 0.8


def run_closed_loop(llm: Any, prompts: list[list[int]], params: SamplingParams,
                    concurrency: int, clock: StepClock | None = None) -> tuple[float, int]:
    """Run ``prompts`` with at most ``concurrency`` in the engine at once, each finished
    request replaced by the next; wall seconds (device work included) and tokens generated."""
    engine = llm.engine
    queue = list(enumerate(prompts))
    queue.reverse()
    live = generated = 0

    def admit() -> None:
        nonlocal live
        while queue and live < concurrency:
            i, prompt = queue.pop()
            engine.add_request(f"steady-{i}", prompt, params)
            live += 1

    sync_device(llm)
    start = time.perf_counter()
    with observing(engine, clock):
        admit()
        while engine.has_unfinished():
            for d in engine.step():
                generated += len(d.new_token_ids)
                if d.finished:
                    live -= 1
            admit()
    sync_device(llm)
    return time.perf_counter() - start, generated


def sync_device(llm: Any) -> None:
    """Wait for this process's device work (a driver of worker processes has none: its
    steps return once the workers' samples are on the host)."""
    device = getattr(llm, "device", None)
    if not hasattr(llm.engine, "runner"):
        return
    if isinstance(device, torch.device) and device.type == "cuda":
        torch.cuda.synchronize(device)


def requests_for(min_seconds: float, step_ms: float, concurrency: int, new_tokens: int) -> int:
    """Requests (a whole number of ``concurrency``-wide waves) whose decode steps take at
    least ``min_seconds`` at ``step_ms`` per step; at least one wave."""
    steps = min_seconds * 1e3 / max(step_ms, 1e-6)
    waves = max(1, math.ceil(steps / max(1, new_tokens)))
    return waves * concurrency


def spread(values: list[float]) -> dict[str, float]:
    """Median, min, max, quartiles, and (max - min) / median of ``values``."""
    ordered = sorted(values)
    median = statistics.median(ordered)
    q1, q3 = (statistics.quantiles(ordered, n=4, method="inclusive")[::2]
              if len(ordered) > 1 else (median, median))
    return {"median": median, "min": ordered[0], "max": ordered[-1], "q1": q1, "q3": q3,
            "spread": (ordered[-1] - ordered[0]) / median if median else 0.0}


def tail_attribution(samples: list[StepSample], share: float = 0.01) -> dict[str, Any]:
    """The slowest ``share`` of steps (at least one) and what each coincides with, in this
    order: a prefill in the step or in the one before it (with overlap scheduling the wait
    in a call is for the previous launch), a garbage collection, host work
    (``HOST_BOUND_SHARE`` of the interval), none of these."""
    if not samples:
        return {"steps": 0}
    k = max(1, math.ceil(len(samples) * share))
    slow = sorted(range(len(samples)), key=lambda i: samples[i].ms, reverse=True)[:k]
    causes = {"prefill": 0, "gc": 0, "host": 0, "other": 0}
    for i in slow:
        s, prev = samples[i], samples[i - 1] if i else None
        if s.prefill_tokens or (prev is not None and prev.prefill_tokens):
            causes["prefill"] += 1
        elif s.gc_ms > 0.5 * (s.ms - min(x.ms for x in samples)):
            causes["gc"] += 1
        elif s.host_ms >= HOST_BOUND_SHARE * s.ms:
            causes["host"] += 1
        else:
            causes["other"] += 1
    decode_only = [s.ms for s in samples if not s.prefill_tokens]
    return {"steps": k, "threshold_ms": round(samples[slow[-1]].ms, 4), **causes,
            "mixed_steps": sum(1 for s in samples if s.prefill_tokens and s.decode_tokens),
            "prefill_steps": sum(1 for s in samples if s.prefill_tokens),
            "decode_only_p50_ms": percentile(decode_only, 50),
            "decode_only_p99_ms": percentile(decode_only, 99),
            "gc_ms_total": round(sum(s.gc_ms for s in samples), 3)}


def timed_repeats(llm: Any, prompts: Callable[[int | None], list[list[int]]],
                  params: SamplingParams, concurrency: int, repeats: int
                  ) -> list[tuple[float, int, list[StepSample]]]:
    """``repeats`` closed-loop runs, repeat ``r`` on ``prompts(r)``: wall, tokens, samples."""
    runs = []
    for r in range(max(1, repeats)):
        clock = StepClock(llm.engine.live_stats)
        with clock.gc_pauses():
            wall, generated = run_closed_loop(llm, prompts(r), params, concurrency, clock)
        runs.append((wall, generated, clock.samples))
    return runs
