"""LoRA adapters over the base model, many in one batch and inside the same graphs.

* ``request`` — ``LoRARequest`` (vLLM's names): which adapter a request runs with.
* ``peft`` — reading a PEFT adapter directory into host tensors, checked against the model.
* ``slots`` — the device side: ``max_loras`` adapter slots (static buffers padded to
  ``max_lora_rank``), the per-token slot index every step writes, and the per-layer hook
  that shrinks each targeted projection's delta for the projection op to add
  (``kernels.lora``, ``kernels.skinny_lora``).
* ``manager`` — which adapters are loaded on the host (LRU, ``max_cpu_loras``) and which
  sit in a device slot; the scheduler asks it before admitting a request.
"""

from replaylm.lora.request import LoRARequest

__all__ = ["LoRARequest"]
