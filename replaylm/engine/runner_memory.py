"""The memory operations of ``ModelRunner``: weight updates, sleep and wake, the graph
audit."""

from __future__ import annotations

from replaylm.config import EngineArgs
from replaylm.graphs.audit import AuditReport
from replaylm.graphs.runtime import GraphRuntime
from replaylm.memory.arena import Arena
from replaylm.memory.sleep import Sleeper, SleepReport, WakeReport
from replaylm.model.config import ModelConfig
from replaylm.model.llama import CausalLM
from replaylm.model.weight_update import Source, WeightUpdate, update_weights


class RunnerMemory:
    """Weight updates, sleep and wake, and the pointer audit of a runner; they read its
    ``model``, ``full_cfg``, ``args``, ``sleeper``, ``graphs`` and ``arena``."""

    model: CausalLM
    full_cfg: ModelConfig
    args: EngineArgs
    sleeper: Sleeper | None
    graphs: GraphRuntime
    arena: Arena | None

    def update_weights(self, source: Source) -> WeightUpdate:
        """Copy new weights into this runner's model in place (``model.weight_update``)."""
        return update_weights(self.model, source, self.full_cfg)

    def sleep(self, level: int) -> SleepReport:
        """Release the weights' (level 1: kept on the host) and the KV pool's memory
        (``memory.sleep``); needs ``enable_sleep_mode``."""
        if self.sleeper is None:
            raise ValueError("sleep needs EngineArgs.enable_sleep_mode=True (the weights and "
                             "the KV pool must live in address-stable memory)")
        return self.sleeper.sleep(level)

    def prepare_sleep(self) -> None:
        """With sleep mode and ``sleep_pin_ahead``: pin level 1's host copy on a background
        thread (``Sleeper.prepare_host``). Called once no graph will be captured any more."""
        if self.sleeper is not None and self.args.sleep_pin_ahead:
            self.sleeper.prepare_host()

    def wake_up(self) -> WakeReport:
        """Map the memory back at the same addresses (``memory.sleep``)."""
        if self.sleeper is None:
            raise ValueError("wake_up needs EngineArgs.enable_sleep_mode=True")
        return self.sleeper.wake()

    def audit_graphs(self) -> AuditReport:
        """The pointer audit of every captured graph (``graphs.audit``)."""
        return self.graphs.audit(self.arena)
