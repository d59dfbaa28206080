"""Sizing and allocating a model runner's KV pool (``KVSizing``, a base of ``ModelRunner``):
what the weights, the activation peak of the largest step, the graphs and a partner pool
(a draft model's) leave of ``gpu_memory_utilization``."""

from __future__ import annotations

import logging

import torch

from replaylm.batch import BLOCK_SIZE, AttentionMetadata
from replaylm.graphs.runtime import GraphRuntime
from replaylm.memory.arena import Arena

log = logging.getLogger(__name__)


class KVSizing:
    """Reads the runner's ``args``, ``cfg``, ``device``, ``dtype``, ``model``, ``attn``,
    ``policy``, ``max_model_len``, ``max_blocks_per_req``, ``rows_per_req`` and
    ``kv_partner``."""

    @property
    def block_bytes(self) -> int:
        return self.cfg.kv_bytes_per_token(self.dtype) * BLOCK_SIZE

    def _allocate_kv(self, num_blocks: int, arena: Arena | None = None
                     ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The KV pool, zeroed; with ``arena`` (sleep mode) in its region ``kv``."""
        shape = (self.cfg.num_layers, 2, num_blocks, BLOCK_SIZE, self.cfg.num_kv_heads,
                 self.cfg.head_dim)
        if arena is not None:
            pool = arena.zeros("kv", shape, self.dtype)
        else:
            pool = torch.zeros(shape, dtype=self.dtype, device=self.device)
        return [(pool[i, 0], pool[i, 1]) for i in range(self.cfg.num_layers)]

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
