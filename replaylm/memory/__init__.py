"""Address-stable memory for sleep and wake (``EngineArgs.enable_sleep_mode``).

``arena.Arena`` hands out regions whose addresses never change while their physical memory
comes and goes: on CUDA each region is a reserved virtual range with physical chunks mapped
into it (``vmm``: CUDA virtual memory management through ``cuda.bindings.driver``); on the
CPU a plain buffer that sleeping poisons instead. CUDA graphs captured against tensors of an
arena replay unchanged after the memory is mapped back.
"""
