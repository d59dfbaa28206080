"""Changing a serving engine's memory without recapturing its graphs: in-place weight
updates, sleep and wake (``memory.sleep``), the graph pointer audit and a prefix-cache reset
(``WeightsAndSleep``, a base of ``EngineCore``)."""

from __future__ import annotations

import dataclasses
import logging

from replaylm.config import EngineArgs
from replaylm.engine.block_manager import BlockManager
from replaylm.engine.kv_sizing import KVResize
from replaylm.engine.model_runner import ModelRunner
from replaylm.engine.request import Request
from replaylm.engine.scheduler import Scheduler
from replaylm.engine.stats import EngineStats
from replaylm.graphs.audit import AuditReport
from replaylm.memory.sleep import SleepReport, WakeReport
from replaylm.model.weight_update import Source, WeightUpdate

log = logging.getLogger(__name__)


class WeightsAndSleep:
    """Reads the engine's ``args``, ``runner``, ``block_manager``, ``scheduler``,
    ``requests``, ``max_model_len``, ``stats``, and calls its ``has_unfinished`` and ``drafter``."""

    args: EngineArgs
    runner: ModelRunner
    block_manager: BlockManager
    scheduler: Scheduler
    requests: dict[str, list[Request]]
    max_model_len: int
    stats: EngineStats

    def update_weights(self, source: Source, target: str = "model") -> WeightUpdate:
        """Copy new weights (a checkpoint directory or ``(name, tensor)`` pairs) into the
        model's (``target="draft"``: the draft model's) buffers in place, all checked first
        (``model.weight_update``); a model update drops the prefix cache (old-weight KV)."""
        if target not in ("model", "draft"):
            raise ValueError(f"update_weights: target={target!r} is invalid: 'model' or 'draft'")
        self._awake("update_weights")
        if target == "draft":
            runner = getattr(self.drafter, "runner", None)
            if runner is None:
                raise ValueError("update_weights(target='draft') needs a draft model "
                                 "(speculative_config method 'draft_model')")
            return runner.update_weights(source)
        result = self.runner.update_weights(source)
        self.block_manager.drop_cached_blocks([*self.scheduler.running, *self.scheduler.waiting])
        if self.args.graph_check:
            result = dataclasses.replace(result, audit=self.audit_graphs().as_dict())
        return result

    # Sleep and wake (``memory.sleep``) ----------------------------------------------------------

    def sleep(self, level: int = 1) -> SleepReport:
        """Free the GPU memory of the weights (level 1: copied to host memory first; level
        2: discarded, for ``update_weights`` after waking) and of the KV pool, keeping their
        addresses; the prefix cache is dropped. Needs ``enable_sleep_mode`` and an idle
        engine; requests are refused (``RuntimeError``) until ``wake_up``."""
        if self.has_unfinished():
            raise RuntimeError(f"sleep needs an idle engine: {len(self.requests)} requests "
                               "are unfinished (finish or abort them first)")
        if self.is_sleeping():
            raise RuntimeError(f"the engine is asleep already (level {self.sleep_level})")
        report = self.runner.sleep(level)
        draft = self._draft_sleeper()
        if draft is not None:  # the draft model's weights and KV pool sleep with the target's
            report = _summed(report, draft.sleep(level))
        self.block_manager.drop_cached_blocks()
        log.info("asleep (level %d): %.2f GiB freed on the device in %.2f s", level,
                 report.freed_bytes / 2**30, report.seconds)
        return report

    def wake_up(self) -> WakeReport:
        """Map the weights' and the KV pool's memory back at the same addresses (the graphs
        replay unchanged, never recaptured): level 1's weights are restored, level 2's await
        ``update_weights``; the KV pool starts zeroed and the prefix cache empty. With
        ``graph_check`` the graphs are audited (``audit_graphs``)."""
        if not self.is_sleeping():
            raise RuntimeError("wake_up: the engine is not asleep")
        report = self.runner.wake_up()
        draft = self._draft_sleeper()
        if draft is not None and draft.asleep:
            report = _summed(report, draft.wake())
        if self.args.graph_check:
            report = dataclasses.replace(report, audit=self.audit_graphs().as_dict())
        return report

    @property
    def sleep_level(self) -> int:
        """The level the engine sleeps at (0: awake), as its memory's ``Sleeper`` holds it."""
        sleeper = self.runner.sleeper
        return sleeper.level if sleeper is not None else 0

    def is_sleeping(self) -> bool:
        return self.sleep_level > 0

    # KV pool resize ---------------------------------------------------------------------------

    def resize_kv_cache(self, num_blocks: int) -> KVResize:
        """Grow or shrink the KV pool to ``num_blocks`` blocks (block 0, the scratch block,
        included) within the range reserved at start-up (``max_num_kv_blocks``): physical
        memory is mapped or unmapped at the end of every layer's segment; no tensor, address
        or graph changes. Shrinking evicts the prefix-cached blocks above the new size and
        refuses (``RuntimeError``, nothing changed) while a request holds one. A size outside
        ``[blocks for max_model_len + 1, max_num_kv_blocks]`` is a ``ValueError``; so is a
        pool outside address-stable memory. With ``graph_check`` the graphs are audited."""
        self._awake("resize_kv_cache")
        runner, bm = self.runner, self.block_manager
        runner.check_resize(num_blocks)
        need = bm.blocks_for(self.max_model_len) + 1
        if num_blocks < need:
            raise ValueError(f"resize_kv_cache: num_blocks={num_blocks} is invalid: "
                             f"max_model_len={self.max_model_len} needs at least {need} "
                             "blocks (a lone request must always fit)")
        if num_blocks < bm.num_blocks:
            holders = [r.request_id for r in self.scheduler.holders
                       if any(b >= num_blocks for b in r.block_ids)]
            if holders:
                raise RuntimeError(
                    f"cannot shrink the KV pool to {num_blocks} blocks: requests "
                    f"{holders[:8]} hold blocks above it (finish or abort them first)")
        previous = bm.num_blocks
        evicted = bm.resize(num_blocks)
        try:
            report = runner.resize_kv(num_blocks)
        except BaseException:  # growing ran out of device memory: the old pool stands
            bm.resize(previous)
            raise
        self.stats.kv_blocks_total = num_blocks - 1
        report = dataclasses.replace(report, evicted_blocks=evicted)
        if self.args.graph_check:
            report = dataclasses.replace(report, audit=self.audit_graphs().as_dict())
        return report

    def audit_graphs(self) -> AuditReport:
        """Check that no captured graph holds an address of unmapped or freed memory
        (``graphs.audit``); raises ``GraphAuditError`` naming the graph, kernel and parameter."""
        report = self.runner.audit_graphs()
        draft = getattr(self.drafter, "runner", None)
        if draft is not None and getattr(draft, "graphs", None) is not None:
            report = _summed(report, draft.audit_graphs())
        return report

    def _draft_sleeper(self):
        """The draft model's ``Sleeper`` (sleep mode with a ``draft_model`` drafter), or None."""
        return getattr(getattr(self.drafter, "runner", None), "sleeper", None)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (``BlockManager.drop_cached_blocks``); the blocks freed."""
        return self.block_manager.drop_cached_blocks(
            [*self.scheduler.running, *self.scheduler.waiting])

    def _awake(self, what: str) -> None:
        if self.is_sleeping():
            raise RuntimeError(f"{what}: the engine is asleep (level {self.sleep_level}): "
                               "call wake_up() first")



def _summed(a, b):
    """``a`` (the target's report) with ``b``'s (the draft model's) byte counts, graph counts
    and seconds added; the other fields are ``a``'s."""
    sums = {f.name: getattr(a, f.name) + getattr(b, f.name) for f in dataclasses.fields(a)
            if f.name not in ("level", "audit") and isinstance(getattr(a, f.name), int | float)}
    return dataclasses.replace(a, **sums)
