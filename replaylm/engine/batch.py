"""The one batch format (DESIGN.md): every forward pass takes one front-packed batch.

A step is first laid out on the host (``HostBatch``, numpy), then copied into the persistent
static buffers, padded to a graph's tier or not (``replaylm.graphs.buffers``); only an eager
step too large for them gets fresh device tensors (``to_device``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from replaylm.attention.backend import BLOCK_SIZE, AttentionMetadata
from replaylm.engine.scheduler import SchedulerOutput


@dataclass
class HostBatch:
    """The real (unpadded) batch on the host."""

    input_ids: np.ndarray  # [T] int64; rows in ``from_device_rows`` are placeholders
    from_device_rows: np.ndarray  # [F] int64: rows fed from last_token on the device
    from_device_slots: np.ndarray  # [F] int64: the slot whose last_token each such row reads
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    cu_seqlens_q: np.ndarray  # [B+1] int32
    kv_lens: np.ndarray  # [B] int32
    req_slots: np.ndarray  # [B] int32: each request's slot (its row of the block tables)
    table_index: np.ndarray  # [U] int32: flat ``slot * max_blocks + column`` of new blocks
    table_value: np.ndarray  # [U] int32: the block ids to write there
    logits_indices: np.ndarray  # [L] int64
    sample_slots: np.ndarray  # [L] int64
    sample_out_pos: np.ndarray  # [L] int64

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_reqs(self) -> int:
        return len(self.kv_lens)

    @property
    def num_sampled(self) -> int:
        return len(self.logits_indices)

    @property
    def max_q_len(self) -> int:
        return int(np.diff(self.cu_seqlens_q).max())

    @property
    def is_uniform_decode(self) -> bool:
        """Every request adds exactly one token and samples it (what ``full`` graphs serve)."""
        return self.num_tokens == self.num_reqs == self.num_sampled


@dataclass
class ForwardBatch:
    """Device tensors of one step (possibly padded views of the static buffers).

    ``gather`` / ``req_slots`` are set for steps on the static buffers: ``input_ids`` and
    ``meta.block_table`` are then gathered on the device (``StaticBuffers.gather_inputs``).
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata  # cu_seqlens_q, kv_lens, block_table, slot_mapping
    logits_indices: torch.Tensor  # [L] int64: packed rows whose logits are sampled
    sample_slots: torch.Tensor  # [L] int64: request slot of each sampled row
    sample_out_pos: torch.Tensor  # [L] int64: output index of the token each row samples
    gather: torch.Tensor | None = None  # [T] int64: index into last_token ++ host ids
    req_slots: torch.Tensor | None = None  # [B] int32: rows of the per-slot block tables


def build_host_batch(out: SchedulerOutput, max_blocks: int) -> HostBatch:
    """Front-pack the scheduled requests on the host.

    A token that is the request's latest sample is not taken from the host: it is gathered on
    the device from ``last_token[slot]``, where the sampler left it, so building step N+1 never
    needs step N's tokens on the host (overlap scheduling relies on it: such a token may still
    be pending). Block tables are per slot and persistent on the device: only the blocks a
    request gained since its previous step are listed (``table_index`` / ``table_value``).
    """
    for req in out.newly_slotted:
        req.device_token_slot = -1  # whatever last_token[slot] holds belongs to someone else
        req.table_len = 0  # the slot's device table row holds someone else's blocks
    ids: list[int] = []
    from_rows: list[int] = []
    from_slots: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    cu = [0]
    kv_lens: list[int] = []
    req_slots: list[int] = []
    t_index: list[int] = []
    t_value: list[int] = []
    logits_idx: list[int] = []
    sample_slots: list[int] = []
    out_pos: list[int] = []
    # Plain Python lists, one numpy conversion each at the end: at 256 decoding requests this
    # loop is per-step host time, and small numpy arrays per request cost more than they save.
    for sr in out.scheduled:
        req, start, n = sr.request, sr.start, sr.num_new_tokens
        base = len(ids)
        end = start + n
        ids.extend(req.token_slice(start, end))
        last_out = req.num_tokens - 1
        if last_out >= req.num_prompt_tokens and start <= last_out < end \
                and req.device_token_slot == req.slot:
            from_rows.append(base + last_out - start)
            from_slots.append(req.slot)
        elif req.num_pending:
            raise AssertionError(f"{req!r}: a pending token must be read on the device")
        blocks = req.block_ids
        if len(blocks) > req.table_len:
            row = req.slot * max_blocks
            t_index.extend(range(row + req.table_len, row + len(blocks)))
            t_value.extend(blocks[req.table_len:])
            req.table_len = len(blocks)
        if n == 1:
            positions.append(start)
            slots.append(blocks[start // BLOCK_SIZE] * BLOCK_SIZE + start % BLOCK_SIZE)
        else:
            pos = np.arange(start, end)
            b = np.asarray(blocks, dtype=np.int64)
            positions.extend(range(start, end))
            slots.extend((b[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE).tolist())
        cu.append(len(ids))
        kv_lens.append(end)
        req_slots.append(req.slot)
        if sr.sample:
            req.device_token_slot = req.slot  # the sampler writes last_token[slot]
            logits_idx.append(len(ids) - 1)
            sample_slots.append(req.slot)
            out_pos.append(req.num_generated)
    i64, i32 = np.int64, np.int32
    return HostBatch(
        input_ids=np.asarray(ids, dtype=i64),
        from_device_rows=np.asarray(from_rows, dtype=i64),
        from_device_slots=np.asarray(from_slots, dtype=i64),
        positions=np.asarray(positions, dtype=i64),
        slot_mapping=np.asarray(slots, dtype=i64),
        cu_seqlens_q=np.asarray(cu, dtype=i32),
        kv_lens=np.asarray(kv_lens, dtype=i32),
        req_slots=np.asarray(req_slots, dtype=i32),
        table_index=np.asarray(t_index, dtype=i32),
        table_value=np.asarray(t_value, dtype=i32),
        logits_indices=np.asarray(logits_idx, dtype=i64),
        sample_slots=np.asarray(sample_slots, dtype=i64),
        sample_out_pos=np.asarray(out_pos, dtype=i64),
    )


def feed_sampled_tokens(input_ids: torch.Tensor, host: HostBatch, last_token: torch.Tensor) -> None:
    """Write the previous step's samples (still on the device) into ``input_ids``."""
    if len(host.from_device_rows):
        dev = input_ids.device
        rows = torch.from_numpy(host.from_device_rows).to(dev, non_blocking=True)
        src = torch.from_numpy(host.from_device_slots).to(dev, non_blocking=True)
        input_ids.index_copy_(0, rows, last_token.index_select(0, src))


def to_device(host: HostBatch, last_token: torch.Tensor, slot_tables: torch.Tensor,
              device: torch.device, host_attn_lengths: bool) -> ForwardBatch:
    """Fresh device tensors for an eager step too large for the static buffers (no padding)."""

    def dev(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device, non_blocking=True)

    input_ids = dev(host.input_ids)
    feed_sampled_tokens(input_ids, host, last_token)
    cu = host.cu_seqlens_q.tolist()
    kv = host.kv_lens.tolist()
    meta = AttentionMetadata(
        cu_seqlens_q=dev(host.cu_seqlens_q),
        kv_lens=dev(host.kv_lens),
        block_table=slot_tables.index_select(0, dev(host.req_slots)),
        slot_mapping=dev(host.slot_mapping),
        num_tokens=host.num_tokens,
        num_reqs=host.num_reqs,
        max_q_len=host.max_q_len,
        max_kv_len=max(kv),
        cu_seqlens_q_cpu=cu if host_attn_lengths else None,
        kv_lens_cpu=kv if host_attn_lengths else None,
    )
    return ForwardBatch(
        input_ids=input_ids,
        positions=dev(host.positions),
        meta=meta,
        logits_indices=dev(host.logits_indices),
        sample_slots=dev(host.sample_slots),
        sample_out_pos=dev(host.sample_out_pos),
    )
