"""Sizing and allocating a model runner's KV pool (``KVSizing``, a base of ``ModelRunner``):
what the weights, the activation peak of the largest step, the graphs and a partner pool
(a draft model's) leave of ``gpu_memory_utilization``."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from replaylm.batch import BLOCK_SIZE, AttentionMetadata
from replaylm.graphs.runtime import GraphRuntime
from replaylm.memory.arena import Arena

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVResize:
    """What ``resize_kv_cache`` did: the pool's block count before and after and the most it
    may hold (``max_num_blocks``), the pool's physical bytes after (``mapped_bytes``), the
    change of the device's free memory as the driver reports it (``freed_bytes`` when it
    rose, ``taken_bytes`` when it fell; 0 on the CPU), the prefix-cached blocks evicted from
    above the new size, the seconds, and the graph audit's summary when one ran."""

    num_blocks: int
    previous_blocks: int
    max_num_blocks: int
    mapped_bytes: int
    freed_bytes: int
    taken_bytes: int
    evicted_blocks: int = 0
    seconds: float = 0.0
    audit: dict | None = None


class KVSizing:
    """Reads the runner's ``args``, ``cfg``, ``device``, ``dtype``, ``model``, ``attn``,
    ``policy``, ``max_model_len``, ``max_blocks_per_req``, ``rows_per_req`` and
    ``kv_partner``."""

    @property
    def block_bytes(self) -> int:
        return self.cfg.kv_bytes_per_token(self.dtype) * BLOCK_SIZE

    @property
    def layer_block_bytes(self) -> int:
        """Bytes of one block of one layer's K (or V) cache."""
        return BLOCK_SIZE * self.cfg.num_kv_heads * self.cfg.head_dim * self.dtype.itemsize

    def _allocate_kv(self, num_blocks: int, arena: Arena | None = None, capacity: int = 0
                     ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The KV pool, zeroed: per layer a K and a V tensor ``[blocks, 16, Hkv, D]``.

        Without ``arena`` one plain tensor holds them all. With it (sleep mode or
        ``max_num_kv_blocks``) each layer's K and each layer's V is a segment of the arena's
        region ``kv`` reserved for ``capacity`` blocks (at least ``num_blocks``), of which
        the first ``num_blocks`` blocks are mapped; the tensors cover the whole reservation,
        so their addresses and strides never change when ``resize_kv`` maps more or fewer
        blocks at the end of every segment. (One region laid out ``[layer, k|v, block]``
        would put each layer's last blocks in the middle of the range, so a resize could not
        simply map or unmap the end; a block-major layout would, but would make every layer's
        block stride span all layers, which the torch attention backends' ``view`` calls do
        not accept.)"""
        cfg = self.cfg
        if arena is None:
            shape = (cfg.num_layers, 2, num_blocks, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
            pool = torch.zeros(shape, dtype=self.dtype, device=self.device)
            return [(pool[i, 0], pool[i, 1]) for i in range(cfg.num_layers)]
        capacity = max(capacity, num_blocks)
        per = self.layer_block_bytes
        region = arena.segmented("kv", 2 * cfg.num_layers, capacity * per, num_blocks * per)
        shape = (capacity, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
        views = [region.view(j * region.segment, self.dtype, shape)
                 for j in range(2 * cfg.num_layers)]
        return [(views[2 * i], views[2 * i + 1]) for i in range(cfg.num_layers)]

    def _aligned_blocks(self, num_blocks: int, arena: Arena | None) -> int:
        """``num_blocks`` rounded down to whole mapping granules per segment (sized by memory
        on CUDA: each of the 2 x layers segments is mapped in granules, so an unaligned count
        would map up to a granule per segment beyond the budget)."""
        if arena is None or not arena.cuda or self.args.num_kv_blocks is not None:
            return num_blocks
        per = self.layer_block_bytes
        step = arena.granularity // per if arena.granularity % per == 0 else 1
        return max(2, num_blocks // max(step, 1) * max(step, 1))

    def resize_kv(self, num_blocks: int) -> KVResize:
        """Map the first ``num_blocks`` blocks of every layer's K and V segment and unmap the
        rest (``Arena.fit``); no tensor or graph changes. The caller (the engine) has checked
        that no block at or above ``num_blocks`` is held."""
        self.check_resize(num_blocks)
        region = self.arena.regions["kv"]
        t0 = time.perf_counter()
        before = _free(self.device)
        region.fit(num_blocks * self.layer_block_bytes)
        after = _free(self.device)
        previous, self.num_blocks = self.num_blocks, num_blocks
        log.info("KV pool resized: %d -> %d blocks (%.1f MiB mapped)", previous, num_blocks,
                 region.chunk_bytes / 2**20)
        return KVResize(num_blocks, previous, self.kv_capacity, region.chunk_bytes,
                        max(0, after - before), max(0, before - after),
                        seconds=time.perf_counter() - t0)

    def check_resize(self, num_blocks: int) -> None:
        """``ValueError`` unless the pool can be resized to ``num_blocks``."""
        if self.arena is None or "kv" not in self.arena.regions:
            raise ValueError("resize_kv_cache needs the KV pool in address-stable memory: set "
                             "EngineArgs.max_num_kv_blocks (the largest size it may grow to) "
                             "or enable_sleep_mode")
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) \
                or not 2 <= num_blocks <= self.kv_capacity:
            raise ValueError(f"resize_kv_cache: num_blocks={num_blocks!r} is invalid: must be "
                             f"an int in [2, {self.kv_capacity}] (max_num_kv_blocks, the "
                             "reserved maximum)")

    def _decide_num_blocks(self) -> int:
        args = self.args
        # More blocks than every slot at full length could ever hold are never used.
        useful = args.max_num_seqs * self.max_blocks_per_req + 1
        if args.num_kv_blocks is not None:
            return args.num_kv_blocks
        partner = self.kv_partner
        per_block = self.block_bytes + (partner.partner_block_bytes if partner else 0)
        fixed = partner.partner_fixed_bytes if partner else 0
        if self.device.type != "cuda":
            return max(2, min(useful, (int(args.cpu_kv_cache_gib * 2**30) - fixed) // per_block))
        peak = self._profile_activation_peak()
        free, total = torch.cuda.mem_get_info(self.device)
        torch_reserved = torch.cuda.memory_reserved(self.device)
        not_ours = total - free - torch_reserved
        weights = torch.cuda.memory_allocated(self.device)
        graphs = self._estimate_graph_bytes(peak)
        budget = total * args.gpu_memory_utilization - not_ours - weights - peak - graphs - fixed
        blocks = int(budget // per_block)
        log.info("KV sizing: total %.1f GiB, weights %.2f GiB, activation peak %.2f GiB, "
                 "graphs (estimate) %.2f GiB, other %.2f GiB, partner pool %.2f GiB + %d B per "
                 "block -> %d blocks", total / 2**30, weights / 2**30, peak / 2**30,
                 graphs / 2**30, not_ours / 2**30, fixed / 2**30, per_block - self.block_bytes,
                 blocks)
        if blocks < 2:
            raise ValueError(
                f"no GPU memory left for the KV cache (weights {weights / 2**30:.2f} GiB, "
                f"activation peak {peak / 2**30:.2f} GiB): raise gpu_memory_utilization or "
                "lower max_num_batched_tokens"
            )
        return min(blocks, useful)

    @property
    def kv_capacity(self) -> int:
        """The most blocks the pool may hold: the reserved size of its segments (without
        address-stable memory, its size)."""
        return self.kv_caches[0][0].shape[0]

    def _estimate_graph_bytes(self, profile_peak: int) -> int:
        """Memory the graphs will hold, reserved before the KV pool is sized.

        Graphs share one pool, captured largest first, so it holds about one activation peak
        of the top tier (scaled from the profiling run), plus the runners' static buffers.
        """
        top = self.policy.top_tier
        if top == 0:
            return 0
        profiled = min(self.args.max_num_batched_tokens, self.max_model_len)
        acts = profile_peak * min(1.0, top / profiled)
        static = GraphRuntime.estimate_static_bytes(
            self.policy, vocab_size=self.cfg.vocab_size, q_size=self.cfg.q_size,
            dtype=self.dtype, max_num_seqs=self.args.max_num_seqs,
            rows_per_req=self.rows_per_req)
        return int(acts + static + 64 * 2**20)

    @torch.inference_mode()
    def _profile_activation_peak(self) -> int:
        """Run the largest step once on a throwaway cache; return its activation peak in bytes."""
        n = min(self.args.max_num_batched_tokens, self.max_model_len)
        blocks = -(-n // BLOCK_SIZE) + 1
        caches = self._allocate_kv(blocks)
        self.model.bind(self.attn, caches, self.max_model_len)
        torch.cuda.synchronize(self.device)
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        meta = AttentionMetadata(
            cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=self.device),
            kv_lens=torch.tensor([n], dtype=torch.int32, device=self.device),
            block_table=torch.arange(1, blocks, dtype=torch.int32, device=self.device)[None],
            slot_mapping=torch.arange(BLOCK_SIZE, BLOCK_SIZE + n, device=self.device),
            num_tokens=n, num_reqs=1, max_q_len=n, max_kv_len=n,
            cu_seqlens_q_cpu=[0, n], kv_lens_cpu=[n],
        )
        ids = torch.zeros(n, dtype=torch.int64, device=self.device)
        pos = torch.arange(n, device=self.device)
        hidden = self.model(ids, pos, meta)
        self.model.compute_logits(hidden[-min(n, self.args.max_num_seqs * self.rows_per_req):])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        del caches, hidden
        torch.cuda.empty_cache()
        return peak


def _free(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    return torch.cuda.mem_get_info(device)[0]
