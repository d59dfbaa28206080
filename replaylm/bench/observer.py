"""Step observers (``engine.observer.StepObserver``) that benchmarks set on an engine.

``StepClock`` notes when every ``step()`` returns, which gives the step intervals a request
sees between its tokens. The full per-step profiler is ``replaylm.bench.profile.StepProfiler``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from replaylm.engine.observer import NO_OBSERVER, StepObserver

__all__ = ["StepClock", "StepObserver", "observing"]


class StepClock(StepObserver):
    """``perf_counter`` at the return of every ``step()``."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def end(self, launched: bool) -> None:
        self.ends.append(time.perf_counter())

    def intervals_ms(self) -> list[float]:
        """Milliseconds between consecutive step returns."""
        return [(b - a) * 1e3 for a, b in zip(self.ends, self.ends[1:])]


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
