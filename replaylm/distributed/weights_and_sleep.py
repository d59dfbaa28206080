"""Weight updates, sleep and wake, and the graph audit across worker processes
(``RanksWeightsAndSleep``, a base of ``MultiProcessEngine``): each data-parallel leader runs
the operation (``EngineCore``'s) and hands it to its tensor-parallel followers."""

from __future__ import annotations

import dataclasses
from time import perf_counter

from replaylm.engine.kv_sizing import KVResize
from replaylm.graphs.audit import AuditReport, GraphAuditError
from replaylm.memory.sleep import SleepReport, WakeReport
from replaylm.model.weight_update import Source, WeightUpdate, wire_source


class RanksWeightsAndSleep:
    """Reads the driver's ``leaders`` and ``sleep_level``; calls its ``_call`` (one message
    to one rank and its reply) and ``has_unfinished``."""

    leaders: list[int]
    sleep_level: int

    def update_weights(self, source: Source, target: str = "model") -> WeightUpdate:
        """Copy new weights into every rank's model in place (``EngineCore.update_weights``):
        a directory goes to the ranks as its path (each reads its slices), tensors as CPU
        copies (``weight_update.wire_source``). Each data-parallel leader checks the whole
        call before copying and hands it to its tensor-parallel followers; the first one's
        refusal raises ``ValueError`` before any rank copied (every rank checks the same
        names, shapes and dtypes). Returns data-parallel rank 0's counts and the seconds
        the whole call took."""
        t0 = perf_counter()
        payload = wire_source(source)
        first = None
        if self.is_sleeping():
            raise RuntimeError("update_weights: the engine is asleep: call wake_up() first")
        for value in self._each_leader("update_weights", payload, target):
            first = first or value
        return dataclasses.replace(first, seconds=perf_counter() - t0)

    # Sleep and wake, the graph audit ----------------------------------------------------------

    def sleep(self, level: int = 1) -> SleepReport:
        """Every rank sleeps (``EngineCore.sleep``; each leader hands it to its tensor-parallel
        followers). Returns rank 0's report with ``freed_bytes``, ``released_bytes`` and
        ``backup_bytes`` summed over the data-parallel leaders, and the whole call's seconds."""
        if self.has_unfinished():
            raise RuntimeError("sleep needs an idle engine: requests are unfinished (finish or "
                               "abort them first)")
        t0 = perf_counter()
        reports = self._each_leader("sleep", level)
        self.sleep_level = level
        first = reports[0]
        return dataclasses.replace(
            first, freed_bytes=sum(r.freed_bytes for r in reports),
            released_bytes=sum(r.released_bytes for r in reports),
            backup_bytes=sum(r.backup_bytes for r in reports), seconds=perf_counter() - t0)

    def wake_up(self) -> WakeReport:
        """Every rank wakes (``EngineCore.wake_up``); rank 0's report, the call's seconds."""
        t0 = perf_counter()
        reports = self._each_leader("wake_up")
        self.sleep_level = 0
        return dataclasses.replace(reports[0], seconds=perf_counter() - t0)

    def is_sleeping(self) -> bool:
        return self.sleep_level > 0

    def audit_graphs(self) -> AuditReport:
        """Every data-parallel leader audits its graphs; the counts summed, the seconds of
        the whole call."""
        t0 = perf_counter()
        reports = self._each_leader("audit_graphs")
        total = {k: sum(getattr(r, k) for r in reports)
                 for k in ("graphs", "kernels", "params", "words", "pointers", "unreadable")}
        return AuditReport(**total, seconds=perf_counter() - t0)

    def reset_prefix_cache(self) -> int:
        return sum(self._each_leader("reset_prefix_cache"))

    def resize_kv_cache(self, num_blocks: int) -> KVResize:
        """Every data-parallel rank resizes its pool (``EngineCore.resize_kv_cache``; each
        leader hands it to its tensor-parallel followers, whose block ids are the leader's).
        Returns rank 0's report with ``freed_bytes``, ``taken_bytes``, ``mapped_bytes`` and
        ``evicted_blocks`` summed over the data-parallel leaders, and the call's seconds. A
        refusal raises at the first rank that refuses: the ranks before it have resized."""
        if self.is_sleeping():
            raise RuntimeError("resize_kv_cache: the engine is asleep: call wake_up() first")
        t0 = perf_counter()
        reports = self._each_leader("resize_kv_cache", num_blocks)
        return dataclasses.replace(
            reports[0], **{k: sum(getattr(r, k) for r in reports)
                           for k in ("freed_bytes", "taken_bytes", "mapped_bytes",
                                     "evicted_blocks")},
            seconds=perf_counter() - t0)

    def _each_leader(self, op: str, *args) -> list:
        """``op`` on every data-parallel leader in turn; a refusal raises as the rank raised
        it (``ValueError``, ``RuntimeError`` or ``GraphAuditError``)."""
        out = []
        for g in self.leaders:
            status, value = self._call(g, op, *args)
            if status == "invalid":
                raise ValueError(value)
            if status == "refused":
                kind, message = value
                raise (GraphAuditError if kind == "GraphAuditError" else RuntimeError)(
                    f"rank {g}: {message}")
            out.append(value)
        return out
