"""``StepObserver``: the hooks ``EngineCore.step`` calls on every step.

The engine's observer is this no-op base by default; ``replaylm.bench`` subclasses it (the
step clock, the per-step profiler) and sets ``engine.step_observer`` while it measures.
"""

from __future__ import annotations


class StepObserver:
    """begin, launching (right before the step's first device operation), launched, waited
    (seconds spent waiting for a step's samples), end. Each does nothing here."""

    def begin(self) -> None:
        pass

    def launching(self) -> None:
        pass

    def launched(self, mode: str, tier: int | None, tokens: int) -> None:
        pass

    def waited(self, seconds: float) -> None:
        pass

    def end(self, launched: bool) -> None:
        pass


#: The observer an engine starts with.
NO_OBSERVER = StepObserver()
