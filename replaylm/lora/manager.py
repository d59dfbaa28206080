"""Which adapters are loaded where: ``LoRAManager``.

Three tiers, as vLLM has them:

* known — every ``LoRARequest`` the engine has seen (by id and by name), so an adapter
  evicted from host memory is read again from its path when needed (one ``remove``d keeps
  its id for the requests already queued with it; its name is free again);
* host — up to ``max_cpu_loras`` adapters read and checked (``peft.load_adapter``), least
  recently used evicted first;
* device — ``max_loras`` slots (``slots.LoRASlots``). A slot is *held* by every running
  request that uses its adapter (``hold`` / ``release``); a slot no request holds keeps its
  adapter (a later request reuses it) until another adapter needs the slot, least recently
  released first.

The scheduler asks ``ready(req)`` before admitting a request: True when its adapter sits in
a slot; otherwise, with a slot free, the adapter's copy into it starts (on CUDA on a side
stream, non-blocking from pinned memory, so running steps go on) and the request waits in
the queue until the copy is done. Steps never wait for a copy.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from replaylm.lora.peft import HostAdapter, load_adapter
from replaylm.lora.request import LoRARequest
from replaylm.lora.slots import LoRASlots
from replaylm.model.config import ModelConfig
from replaylm.model.parallel import TensorParallel

log = logging.getLogger(__name__)


@dataclass
class _Loading:
    slot: int
    event: torch.cuda.Event | None
    adapter: HostAdapter  # keeps the pinned source alive until the copy is done
    start: float


class LoRAManager:
    def __init__(self, cfg: ModelConfig, slots: LoRASlots, max_cpu_loras: int,
                 tp: TensorParallel | None = None) -> None:
        """``cfg``: the whole model's shapes (adapters are checked against them); ``tp``:
        this rank's place in its tensor-parallel group (adapters are sharded for it)."""
        self.cfg, self.slots, self.tp = cfg, slots, tp
        # Tensor parallel leader: told every slot change, ``("lora_load", slot, request)`` or
        # ``("lora_clear", slot)``, so the other ranks' slots hold the same adapters.
        self.mirror: Callable[[tuple], None] | None = None
        self.max_cpu_loras = max_cpu_loras
        self.known: dict[int, LoRARequest] = {}
        self.by_name: dict[str, LoRARequest] = {}
        self.removed: set[int] = set()  # ids ``remove``d: known only for requests queued
        self.host: OrderedDict[int, HostAdapter] = OrderedDict()
        n = slots.max_loras
        self.slot_adapter: list[int | None] = [None] * n  # adapter id in each slot
        self.holders = [0] * n  # running requests holding each slot
        self.idle: OrderedDict[int, None] = OrderedDict()  # loaded, unheld slots (LRU first)
        self.free = list(range(n))  # empty slots
        self.loading: dict[int, _Loading] = {}  # adapter id -> its copy in progress
        cuda = slots.device.type == "cuda"
        self.stream = torch.cuda.Stream(slots.device) if cuda else None
        self.loads = 0
        # Copies started, and the seconds from each copy's start to the scheduler seeing it
        # done (summed; the scheduler looks once per step).
        self.load_wait_seconds = 0.0

    # Adapters --------------------------------------------------------------------------------

    def add(self, request: LoRARequest) -> None:
        """Know ``request``'s adapter: read and checked now, onto the host, the first time
        it is seen (later it is read again from its path whenever evicted);
        ``ValueError`` for a bad adapter, or an id or name already given to another
        adapter."""
        lid = request.lora_int_id
        same = self.known.get(lid)
        if same is not None and same != request:
            raise ValueError(f"lora_int_id {lid} is already adapter {same.lora_name!r} "
                             f"({same.lora_path}); got {request}")
        other = self.by_name.get(request.lora_name)
        if other is not None and other != request:
            raise ValueError(f"LoRA adapter name {request.lora_name!r} is already in use by "
                             f"lora_int_id {other.lora_int_id} ({other.lora_path})")
        if same is None or lid in self.removed:
            self._host_adapter(request)
        self.removed.discard(lid)
        self.known[lid] = request
        self.by_name[request.lora_name] = request

    def remove(self, name: str) -> LoRARequest:
        """Stop taking new requests for the adapter called ``name`` (``KeyError`` if
        unknown); requests already queued or running with it finish with it, and its slot
        empties once none holds it."""
        request = self.by_name.pop(name)
        lid = request.lora_int_id
        self.removed.add(lid)
        self.host.pop(lid, None)
        for slot, held in enumerate(self.slot_adapter):
            if held == lid and self.holders[slot] == 0 and lid not in self.loading:
                self._empty(slot)
        return request

    def _host_adapter(self, request: LoRARequest) -> HostAdapter:
        lid = request.lora_int_id
        adapter = self.host.get(lid)
        if adapter is not None and adapter.request == request:
            self.host.move_to_end(lid)
            return adapter
        adapter = load_adapter(request, self.cfg, self.slots.max_rank, self.slots.dtype,
                               pin=self.stream is not None, tp=self.tp)
        self.host[lid] = adapter
        while len(self.host) > self.max_cpu_loras:
            self.host.popitem(last=False)  # read again from its path when needed
        return adapter

    # Slots (the scheduler's side) --------------------------------------------------------

    def ready(self, req) -> bool:
        """Whether ``req``'s adapter (``req.lora_int_id``; 0: the base model) is in a slot
        now; if not and a slot is free, its copy starts."""
        lid = req.lora_int_id
        if lid == 0:
            return True
        if lid in self.slot_adapter and lid not in self.loading:
            return True
        pending = self.loading.get(lid)
        if pending is not None:
            if pending.event is not None and not pending.event.query():
                return False
            del self.loading[lid]
            self.load_wait_seconds += time.perf_counter() - pending.start
            return True
        slot = self._take_slot()
        if slot is None:
            return False
        self._start_load(lid, slot)
        return self.ready(req)

    def hold(self, req) -> None:
        """``req`` is admitted: it holds its adapter's slot until ``release``."""
        if req.lora_int_id == 0:
            req.lora_slot = -1
            return
        slot = self.slot_adapter.index(req.lora_int_id)
        self.holders[slot] += 1
        self.idle.pop(slot, None)
        req.lora_slot = slot

    def release(self, req) -> None:
        """``req`` left the running set (finished, aborted, preempted)."""
        slot = req.lora_slot
        if slot < 0:
            return
        req.lora_slot = -1
        self.holders[slot] -= 1
        if self.holders[slot] == 0:
            if self.slot_adapter[slot] in self.removed:
                self._empty(slot)
            else:
                self.idle[slot] = None

    def resident(self) -> dict[int, int]:
        """Adapter id -> slot, for the adapters in a slot (copies done or not)."""
        return {lid: s for s, lid in enumerate(self.slot_adapter) if lid is not None}

    def _take_slot(self) -> int | None:
        if self.free:
            return self.free.pop(0)
        if self.idle:
            slot, _ = self.idle.popitem(last=False)
            self.slot_adapter[slot] = None
            return slot
        return None

    def _empty(self, slot: int) -> None:
        self.idle.pop(slot, None)
        self.slot_adapter[slot] = None
        self.slots.clear(slot)
        if self.mirror is not None:
            self.mirror(("lora_clear", slot))
        if slot not in self.free:
            self.free.append(slot)

    def _start_load(self, lid: int, slot: int) -> None:
        request = self.known.get(lid)
        if request is None:
            raise ValueError(f"LoRA adapter id {lid} is not loaded")
        adapter = self._host_adapter(request)
        self.slot_adapter[slot] = lid
        if self.mirror is not None:  # the other ranks load it before the next step
            self.mirror(("lora_load", slot, request))
        start = time.perf_counter()
        event = None
        if self.stream is not None:
            # The slot is held by no running step: its copy may overlap them.
            with torch.cuda.stream(self.stream):
                self.slots.load(slot, adapter)
                event = torch.cuda.Event()
                event.record(self.stream)
        else:
            self.slots.load(slot, adapter)
        self.loading[lid] = _Loading(slot, event, adapter, start)
        self.loads += 1
        log.debug("LoRA adapter %r -> slot %d", request.lora_name, slot)
