"""Sleep and wake of a model's weights and KV pool, kept in arena regions (``arena``).

``Sleeper.sleep(level)``: level 1 copies the weights to host memory (pinned on CUDA, in pieces
of ``HOST_PIECE_BYTES``, allocated ahead by ``prepare_host`` on a background thread), level 2
keeps no copy (the caller will write new weights: ``update_weights``); then every weight and
KV region is poisoned (0xFF: NaN in every float dtype, so a stale mapping would show) and
released (CUDA: unmapped and its physical memory freed; CPU: left poisoned). ``wake()`` maps
physical memory back at the same addresses, copies level 1's weights back (level 2 leaves the
weights poisoned until they are written) and zeroes the KV pool, as start-up leaves it.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import torch

from replaylm.memory.arena import Arena, Region

log = logging.getLogger(__name__)

#: Size of each piece of level 1's host copy. Torch's pinned-memory allocator rounds every
#: request up to a power of two, so a whole-region buffer could pin up to twice the weights;
#: power-of-two pieces pin what they hold (the last one rounds up to at most its own size).
HOST_PIECE_BYTES = 2**30


@dataclass(frozen=True)
class SleepReport:
    """What ``sleep`` did: ``freed_bytes`` is the rise of the device's free memory as the
    driver reports it (``torch.cuda.mem_get_info``; 0 on the CPU), ``released_bytes`` the
    arena bytes released (weights and KV pool), ``backup_bytes`` the weights kept on the
    host (level 1)."""

    level: int
    freed_bytes: int
    released_bytes: int
    weight_bytes: int
    kv_bytes: int
    backup_bytes: int
    seconds: float


@dataclass(frozen=True)
class WakeReport:
    """What ``wake_up`` did: the level it woke from, ``mapped_bytes`` mapped back (and the
    drop of the device's free memory, ``taken_bytes``), ``restored_bytes`` of weights copied
    back (level 1), the seconds it took, and the graph audit's summary when one ran."""

    level: int
    mapped_bytes: int
    taken_bytes: int
    restored_bytes: int
    seconds: float
    audit: dict | None = None


def device_free(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    return torch.cuda.mem_get_info(device)[0]


class Sleeper:
    """Sleeps and wakes the ``weights`` and ``kv`` regions of one arena."""

    def __init__(self, arena: Arena, weights: list[Region], kv: list[Region]) -> None:
        self.arena, self.weights, self.kv = arena, weights, kv
        self.level = 0  # 0: awake
        # Level 1's host copies, kept after wake for the next sleep: pinning host memory
        # costs far more than the copy itself (seconds for an 8B model, against a third of
        # a second for the copy), and an engine that sleeps once usually sleeps again.
        self._host: dict[str, list[torch.Tensor]] = {}
        self._pinning: threading.Thread | None = None
        self._pin_error: BaseException | None = None
        self.pinned_seconds = 0.0  # how long ``prepare_host``'s allocation took

    def prepare_host(self) -> None:
        """Allocate level 1's host copy now, on a background thread (pinning host memory
        costs seconds for an 8B model: done ahead, the first ``sleep(1)`` only copies). Call
        it once no graph will be captured any more: allocating pinned memory while a graph
        is being captured on another thread is refused by the driver."""
        if self._pinning is not None or self._host:
            return
        self._pinning = threading.Thread(target=self._pin_all, name="replaylm-sleep-pin",
                                         daemon=True)
        self._pinning.start()

    def _pin_all(self) -> None:
        try:
            t0 = time.perf_counter()
            for r in self.weights:
                self._host_pieces(r)
            self.pinned_seconds = time.perf_counter() - t0
            log.info("sleep: %.2f GiB of host memory pinned ahead in %.2f s",
                     sum(r.nbytes for r in self.weights) / 2**30, self.pinned_seconds)
        except BaseException as e:  # raised by the sleep that needs the copy
            self._pin_error = e

    def _host_pieces(self, r: Region) -> list[torch.Tensor]:
        """``r``'s host copy, in pieces of at most ``HOST_PIECE_BYTES`` (allocated once)."""
        pieces = self._host.get(r.name)
        if pieces is None:
            pin = self.arena.cuda
            pieces = [torch.empty(min(HOST_PIECE_BYTES, r.nbytes - off), dtype=torch.uint8,
                                  pin_memory=pin)
                      for off in range(0, r.nbytes, HOST_PIECE_BYTES)]
            self._host[r.name] = pieces
        return pieces

    def wait_host(self) -> None:
        """Wait for ``prepare_host``'s thread; raise what it failed with."""
        if self._pinning is not None:
            self._pinning.join()
            self._pinning = None
        if self._pin_error is not None:
            err, self._pin_error = self._pin_error, None
            self._host.clear()
            raise RuntimeError(f"sleep(level=1): pinning the host copy failed: {err}") from err

    @property
    def asleep(self) -> bool:
        return self.level > 0

    def sleep(self, level: int = 1) -> SleepReport:
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (keep the weights on the host) or 2 "
                             f"(discard them), not {level!r}")
        if self.asleep:
            raise RuntimeError(f"the engine is asleep already (level {self.level})")
        t0 = time.perf_counter()
        device = self.arena.device
        before = device_free(device)
        backup = 0
        if level == 1:
            self.wait_host()
            pin = device.type == "cuda"
            for r in self.weights:
                off = 0
                for host in self._host_pieces(r):  # one copy per piece, queued back to back
                    host.copy_(r.bytes[off:off + host.numel()], non_blocking=pin)
                    off += host.numel()
                backup += r.nbytes
            if pin:
                torch.cuda.synchronize(device)
        released = 0
        for r in self.weights + self.kv:
            r.poison()  # a mapping that went stale reads NaN, never old weights
            r.release()
            released += r.chunk_bytes
        self.level = level
        return SleepReport(level, max(0, device_free(device) - before), released,
                           sum(r.chunk_bytes for r in self.weights),
                           sum(r.chunk_bytes for r in self.kv),
                           backup, time.perf_counter() - t0)

    def wake(self) -> WakeReport:
        if not self.asleep:
            raise RuntimeError("wake_up: the engine is not asleep")
        t0 = time.perf_counter()
        device = self.arena.device
        before = device_free(device)
        mapped = restored = 0
        for r in self.weights + self.kv:
            r.remap()
            mapped += r.chunk_bytes
        for r in self.weights:
            pieces = self._host.get(r.name) if self.level == 1 else None
            if pieces is not None:
                off = 0
                for host in pieces:
                    r.bytes[off:off + host.numel()].copy_(host, non_blocking=self.arena.cuda)
                    off += host.numel()
                restored += r.nbytes
            else:
                r.poison()  # level 2: NaN until update_weights writes the weights
        for r in self.kv:
            r.fill(0)
        taken = max(0, before - device_free(device))  # synchronizes: the copies are done
        level, self.level = self.level, 0
        return WakeReport(level, mapped, taken, restored, time.perf_counter() - t0)
