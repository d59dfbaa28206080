"""``LoRARequest``: the adapter a request runs with (vLLM's fields)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter by name, engine-wide integer id (>= 1; one id, one adapter) and the
    directory holding ``adapter_config.json`` and ``adapter_model.safetensors``."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest.lora_name={self.lora_name!r} must be a non-empty "
                             "string")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) \
                or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id={self.lora_int_id!r} must be an "
                             "integer >= 1")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"LoRARequest.lora_path={self.lora_path!r} must be a path")
