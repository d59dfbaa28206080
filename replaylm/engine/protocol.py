"""``Engine``: what the entry points (``LLM``, the server, the benchmarks) need of an engine.

``EngineCore`` (one process) and ``distributed.MultiProcessEngine`` (worker processes for data
and tensor parallelism) both meet it, so callers never branch on the class.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from replaylm.config import EngineArgs
from replaylm.engine.kv_sizing import KVResize
from replaylm.engine.observer import StepObserver
from replaylm.engine.outputs import RequestDelta
from replaylm.engine.stats import EngineStats
from replaylm.graphs.audit import AuditReport
from replaylm.lora.request import LoRARequest
from replaylm.memory.sleep import SleepReport, WakeReport
from replaylm.model.config import ModelConfig
from replaylm.model.weight_update import Source, WeightUpdate
from replaylm.sampling_params import SamplingParams
from replaylm.speculative.stats import SpecStats


class Added(Protocol):
    """What ``add_request`` reports of a queued request."""

    @property
    def request_id(self) -> str: ...

    @property
    def num_prompt_tokens(self) -> int: ...


class Engine(Protocol):
    """Requests in, per-step deltas out.

    ``step()`` advances every unfinished request and returns what changed
    (``RequestDelta``s); ``stats`` are exact counters (they may ask worker processes),
    ``live_stats`` the same counters as another thread may read them without a message to
    any worker. ``update_weights`` copies new weights into the model's buffers in place
    (``model.weight_update``); ``sleep``/``wake_up`` free and map back the memory of the
    weights and the KV pool at the same addresses (``memory.sleep``), ``resize_kv_cache`` maps
    more or fewer KV blocks under the pool's reserved range, ``audit_graphs`` checks the
    captured graphs' addresses (``graphs.audit``). ``shutdown()`` ends whatever processes
    the engine holds (idempotent).
    """

    args: EngineArgs
    model_config: ModelConfig
    tokenizer: Any
    max_model_len: int
    graph_mode: str
    device: torch.device
    dtype: torch.dtype
    step_observer: StepObserver

    def tokenize(self, prompt: str | list[int], add_special_tokens: bool = True,
                 tokenizer: Any = None) -> list[int]: ...

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None: ...

    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams | None = None,
                    lora_request: LoRARequest | None = None) -> Added: ...

    def add_lora(self, lora_request: LoRARequest | None) -> None: ...

    def remove_lora(self, name: str) -> bool: ...

    def abort(self, request_id: str) -> bool: ...

    def step(self) -> list[RequestDelta]: ...

    def has_unfinished(self) -> bool: ...

    @property
    def stats(self) -> EngineStats: ...

    @property
    def live_stats(self) -> EngineStats: ...

    @property
    def spec_stats(self) -> SpecStats | None: ...

    def graph_stats(self) -> dict: ...

    def update_weights(self, source: Source, target: str = "model") -> WeightUpdate: ...

    def sleep(self, level: int = 1) -> SleepReport: ...

    def wake_up(self) -> WakeReport: ...

    def is_sleeping(self) -> bool: ...

    def audit_graphs(self) -> AuditReport: ...

    def reset_prefix_cache(self) -> int: ...

    def resize_kv_cache(self, num_blocks: int) -> KVResize: ...

    def shutdown(self) -> None: ...
