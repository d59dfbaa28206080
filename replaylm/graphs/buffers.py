"""Static buffers: allocated once for the top tier; every graph reads prefixes of them.

A step copies its real rows into the prefix and fills the rest as padding (DESIGN.md):
padded tokens write scratch block 0 and belong to no request (``cu_seqlens_q[B..S] = T``),
padded request slots have ``kv_lens = 0`` and block-table rows of 0, and padded logits rows
point at row 0; their outputs are dropped.
"""

from __future__ import annotations

import numpy as np
import torch

from replaylm.attention.backend import AttentionMetadata
from replaylm.engine.batch import ForwardBatch, HostBatch, feed_sampled_tokens


class StaticBuffers:
    def __init__(self, max_tokens: int, max_reqs: int, max_blocks: int, device: torch.device,
                 max_kv_len: int) -> None:
        self.max_tokens, self.max_reqs, self.max_kv_len = max_tokens, max_reqs, max_kv_len
        pin = device.type == "cuda"

        def pair(shape, dtype):
            dev = torch.zeros(shape, dtype=dtype, device=device)
            host = torch.zeros(shape, dtype=dtype, pin_memory=pin)
            return dev, host

        i64, i32 = torch.int64, torch.int32
        self.input_ids, self._h_ids = pair(max_tokens, i64)
        self.positions, self._h_pos = pair(max_tokens, i64)
        self.slot_mapping, self._h_slots = pair(max_tokens, i64)
        self.cu_seqlens_q, self._h_cu = pair(max_reqs + 1, i32)
        self.kv_lens, self._h_kv = pair(max_reqs, i32)
        self.block_table, self._h_bt = pair((max_reqs, max_blocks), i32)
        self.logits_indices, self._h_li = pair(max_reqs, i64)
        self.sample_slots, self._h_ss = pair(max_reqs, i64)
        self.sample_out_pos, self._h_op = pair(max_reqs, i64)

    def getters(self) -> dict[str, object]:
        """Name -> getter of every static buffer (for the stand-in's address checks)."""
        names = ("input_ids", "positions", "slot_mapping", "cu_seqlens_q", "kv_lens",
                 "block_table", "logits_indices", "sample_slots", "sample_out_pos")
        return {n: (lambda n=n: getattr(self, n)) for n in names}

    def view(self, num_tokens: int, num_reqs: int, num_logits: int, max_q_len: int) -> ForwardBatch:
        """The fixed-shape views one graph tier is captured with."""
        meta = AttentionMetadata(
            cu_seqlens_q=self.cu_seqlens_q[: num_reqs + 1],
            kv_lens=self.kv_lens[:num_reqs],
            block_table=self.block_table[:num_reqs],
            slot_mapping=self.slot_mapping[:num_tokens],
            num_tokens=num_tokens,
            num_reqs=num_reqs,
            max_q_len=max_q_len,
            max_kv_len=self.max_kv_len,
        )
        return ForwardBatch(
            input_ids=self.input_ids[:num_tokens],
            positions=self.positions[:num_tokens],
            meta=meta,
            logits_indices=self.logits_indices[:num_logits],
            sample_slots=self.sample_slots[:num_logits],
            sample_out_pos=self.sample_out_pos[:num_logits],
        )

    def load(self, host: HostBatch, num_tokens: int, num_reqs: int, num_logits: int,
             last_token: torch.Tensor) -> None:
        """Copy a real batch into the prefixes and pad up to the tier's sizes."""
        t, b, n_l = host.num_tokens, host.num_reqs, host.num_sampled
        assert t <= num_tokens <= self.max_tokens and b <= num_reqs <= self.max_reqs
        assert n_l <= num_logits
        _fill(self._h_ids, host.input_ids, num_tokens, 0)
        _fill(self._h_pos, host.positions, num_tokens, 0)
        _fill(self._h_slots, host.slot_mapping, num_tokens, 0)  # padding -> scratch block 0
        # Every slot past the real ones is empty, up to the top tier's: any graph's view (and
        # the piecewise links, which see all slots) then ends at the real token count.
        _fill(self._h_cu, host.cu_seqlens_q, self.max_reqs + 1, t)
        _fill(self._h_kv, host.kv_lens, num_reqs, 0)
        _fill(self._h_li, host.logits_indices, num_logits, 0)
        _fill(self._h_ss, host.sample_slots, num_logits, 0)
        _fill(self._h_op, host.sample_out_pos, num_logits, 0)
        w = host.block_table.shape[1]
        bt = self._h_bt.numpy()
        bt[:b, :w] = host.block_table
        bt[b:num_reqs] = 0
        for dev, hst, n in (
            (self.input_ids, self._h_ids, num_tokens),
            (self.positions, self._h_pos, num_tokens),
            (self.slot_mapping, self._h_slots, num_tokens),
            (self.cu_seqlens_q, self._h_cu, self.max_reqs + 1),
            (self.kv_lens, self._h_kv, num_reqs),
            (self.block_table, self._h_bt, num_reqs),
            (self.logits_indices, self._h_li, num_logits),
            (self.sample_slots, self._h_ss, num_logits),
            (self.sample_out_pos, self._h_op, num_logits),
        ):
            dev[:n].copy_(hst[:n], non_blocking=True)
        feed_sampled_tokens(self.input_ids, host, last_token)


def _fill(dst: torch.Tensor, src: np.ndarray, n: int, pad: int) -> None:
    a = dst.numpy()
    k = len(src)
    a[:k] = src
    a[k:n] = pad
