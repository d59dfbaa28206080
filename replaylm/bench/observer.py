"""Step observers (``engine.observer.StepObserver``) that benchmarks set on an engine.

``StepClock`` notes when every ``step()`` returns, which gives the step intervals a request
sees between its tokens, and per step what it ran and where its time went
(:class:`StepSample`). The full per-step profiler is ``replaylm.bench.profile.StepProfiler``.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from replaylm.engine.observer import NO_OBSERVER, StepObserver

__all__ = ["StepClock", "StepObserver", "StepSample", "observing"]


@dataclasses.dataclass
class StepSample:
    """One ``step()`` call as the clock saw it.

    ``ms``: since the previous call returned (what a request waits between tokens; the
    first call: since it began);
    ``host_ms``: inside the call, not waiting for samples (scheduling, building inputs,
    launching, applying results); ``wait_ms``: inside the call, waiting for a step's samples;
    the rest of ``ms`` is the caller's own work between calls. ``gc_ms``: Python garbage
    collection pauses during the interval. ``prefill_tokens`` / ``decode_tokens``: what the
    step launched in this call runs (0 / 0 when it launched nothing). With overlap scheduling
    a call waits for the step launched by the call before it, so a long ``wait_ms`` belongs
    to the previous sample's tokens.
    """

    ms: float
    host_ms: float
    wait_ms: float
    gc_ms: float
    prefill_tokens: int
    decode_tokens: int


class StepClock(StepObserver):
    """``perf_counter`` at the return of every ``step()``; with ``stats`` (the engine's
    ``live_stats``), the tokens each launched step ran, read from its ``last_step``."""

    def __init__(self, stats: Any = None) -> None:
        self.ends: list[float] = []
        self.samples: list[StepSample] = []
        self._stats = stats
        self._begin = self._waited = self._gc_total = self._gc_seen = 0.0
        self._gc_start: float | None = None

    def begin(self) -> None:
        self._begin = time.perf_counter()
        self._waited = 0.0

    def waited(self, seconds: float) -> None:
        self._waited += seconds

    def end(self, launched: bool) -> None:
        now = time.perf_counter()
        prev = self.ends[-1] if self.ends else self._begin  # the first call: from its start
        self.ends.append(now)
        rec = getattr(self._stats, "last_step", None) if launched else None
        prefill = int(getattr(rec, "prefill_tokens", 0) or 0) if rec is not None else 0
        real = int(rec.real_tokens) if rec is not None else 0
        inside = (now - self._begin) * 1e3
        gc_ms = (self._gc_total - self._gc_seen) * 1e3
        self._gc_seen = self._gc_total
        self.samples.append(StepSample(
            ms=round((now - prev) * 1e3, 4), host_ms=round(inside - self._waited * 1e3, 4),
            wait_ms=round(self._waited * 1e3, 4), gc_ms=round(gc_ms, 4),
            prefill_tokens=prefill, decode_tokens=real - prefill))

    def intervals_ms(self) -> list[float]:
        """Milliseconds between consecutive step returns."""
        return [(b - a) * 1e3 for a, b in zip(self.ends, self.ends[1:])]

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        elif self._gc_start is not None:
            self._gc_total += time.perf_counter() - self._gc_start
            self._gc_start = None

    @contextmanager
    def gc_pauses(self) -> Iterator[None]:
        """Time Python's garbage collections while the block runs (``StepSample.gc_ms``)."""
        gc.callbacks.append(self._on_gc)
        try:
            yield
        finally:
            gc.callbacks.remove(self._on_gc)


@contextmanager
def observing(core: Any, observer: StepObserver | None) -> Iterator[None]:
    """Set ``core.step_observer`` for the block (``None`` leaves the core alone)."""
    if observer is None:
        yield
        return
    core.step_observer = observer
    try:
        yield
    finally:
        core.step_observer = NO_OBSERVER
