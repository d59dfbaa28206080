"""The engine's LoRA adapters as requests name them: known, held on the host, forgotten
(``lora.manager.LoRAManager`` does the work)."""

from __future__ import annotations

from replaylm.engine.model_runner import ModelRunner
from replaylm.lora.manager import LoRAManager
from replaylm.lora.request import LoRARequest


class AdapterRequests:
    """``EngineCore``'s adapter calls; ``lora`` is None unless ``EngineArgs.enable_lora``."""

    lora: LoRAManager | None
    runner: ModelRunner

    def add_lora(self, lora_request: LoRARequest | None) -> None:
        """Know ``lora_request``'s adapter and hold it on the host (``LoRAManager.add``);
        ``ValueError`` when LoRA is off or the adapter is bad."""
        if lora_request is None:
            return
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest or None, not "
                             f"{type(lora_request).__name__}")
        if self.lora is None:
            raise ValueError("lora_request needs the engine started with enable_lora=True")
        self.lora.add(lora_request)

    def _mirror_lora(self, msg: tuple) -> None:
        """A slot change, sent to the tensor-parallel followers (if any) ahead of the steps
        that use it."""
        if self.runner.broadcast is not None:
            self.runner.broadcast(msg)

    def remove_lora(self, name: str) -> bool:
        """Forget the LoRA adapter called ``name`` (requests running with it finish with
        it); False if the engine does not know it."""
        if self.lora is None or name not in self.lora.by_name:
            return False
        self.lora.remove(name)
        return True
