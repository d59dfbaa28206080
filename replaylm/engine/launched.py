"""A launched step, and what the speculative step needs of the engine core that launches it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from replaylm.batch import HostBatch
from replaylm.config import EngineArgs
from replaylm.engine.model_runner import ModelRunner
from replaylm.engine.outputs import RequestDelta
from replaylm.engine.scheduler import Scheduler, SchedulerOutput
from replaylm.graphs.policy import Dispatch
from replaylm.sampling.step import PendingStep
from replaylm.structured.masks import StructuredOutputs


@dataclass
class Launched:
    """A step on the device: what was scheduled, its pending samples, how it ran.

    ``sampled``: its tokens once waited for (``EngineCore.wait``); ``refused``: once the
    grammars of its constrained requests have taken those tokens, the requests whose token
    a grammar refused (None before)."""

    out: SchedulerOutput
    pending: PendingStep | None
    dispatch: Dispatch
    padded: int
    sampled: list[int] | None = None
    refused: list[tuple[Any, Exception]] | None = None


@dataclass
class Booked:
    """A step scheduled, its host batch built and booked as launched (``Scheduler.launched``)
    ahead of its launch (``EngineCore.launch``): its requests count as in flight."""

    out: SchedulerOutput
    host: HostBatch


class StepHost(Protocol):
    """The engine core's side of a step (``EngineCore``), as ``Speculation.step`` drives it."""

    args: EngineArgs
    max_model_len: int
    scheduler: Scheduler
    runner: ModelRunner
    overlap: bool
    inflight: Launched | None
    structured: StructuredOutputs

    def launch(self, out: SchedulerOutput) -> tuple[Launched | None, list[RequestDelta]]: ...

    def due(self, launched: Launched | None, keep_in_flight: bool) -> list[Launched]: ...

    def wait(self, step: Launched) -> list[int]: ...

    def apply(self, step: Launched, sampled: list[int]) -> list[RequestDelta]: ...
