"""The one batch format: every forward pass takes one front-packed batch.

The new tokens of all requests are laid end to end, whatever each request is doing this
step; decode, verify and prefill chunks differ only in ``cu_seqlens_q``. Request ``i`` owns
packed query rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]``; its context after this step is
``kv_lens[i]`` tokens, so its new tokens sit at absolute positions
``kv_lens[i] - q_len_i .. kv_lens[i] - 1`` and attend causally to everything before them.

KV cache: per layer ``[num_blocks, BLOCK_SIZE, Hkv, D]``; slot ``s`` lives at
``cache[s // BLOCK_SIZE, s % BLOCK_SIZE]``. Block 0 is reserved by the allocator: the
scratch block that padded tokens write.

Padding (a batch of T real tokens / B requests run at T_pad tokens / S slots):
``cu_seqlens_q[B..S] = T``, ``kv_lens[B..S] = 0``, ``block_table[B..S] = 0``; tokens
``T..T_pad`` belong to no request and write scratch block 0 through ``slot_mapping``.

A step is first laid out on the host (``HostBatch``, numpy; ``engine.packing``), then copied
into the persistent static buffers, padded to a graph's tier or not (``graphs.buffers``);
only an eager step too large for them gets fresh device tensors (``to_device``). This module
sits below the engine, the graphs, the model and the kernels, and imports none of them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

BLOCK_SIZE = 16  # tokens per KV block; fixed across the project

@dataclass
class AttentionMetadata:
    """Device tensors of one step, built once per step; layers read it, nothing mutates it.

    ``num_tokens`` / ``num_reqs`` are the (possibly padded) sizes the tensors have;
    ``max_q_len`` / ``max_kv_len`` are host-known upper bounds (for a graph: of its tier),
    so no backend needs to read a length back from the device.
    """

    cu_seqlens_q: torch.Tensor  # [S+1] int32
    kv_lens: torch.Tensor  # [S] int32
    block_table: torch.Tensor  # [S, max_blocks] int32
    slot_mapping: torch.Tensor  # [T] int64
    num_tokens: int
    num_reqs: int
    max_q_len: int
    max_kv_len: int
    # Host copies for the torch reference backend (never read by graph-safe backends).
    cu_seqlens_q_cpu: list[int] | None = None
    kv_lens_cpu: list[int] | None = None


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
    # Verify steps only (some request verifies drafts, so it samples k + 1 rows): per sampled
    # row, the draft its sample must equal for the request to go on (-1 on a request's last
    # row), and the request's first sampled row (``speculative.acceptance.emitted_rows``).
    draft_next: np.ndarray | None = None  # [L] int64
    seg_start: np.ndarray | None = None  # [L] int64
    # Padding rows inside requests' segments (the ``padded`` verify layout), counted in
    # ``num_tokens``; the graph statistics count them as padding.
    layout_pad_tokens: int = 0
    # Verify rows of requests with penalties: row ``draft_count_rows[i]`` counts token
    # ``draft_count_tokens[i]`` (a draft before it) as an output when penalised.
    draft_count_rows: np.ndarray | None = None  # [P] int64
    draft_count_tokens: np.ndarray | None = None  # [P] int64
    # LoRA: each request's adapter slot (-1: the base model); None when no request of the
    # step runs an adapter (``replaylm.lora``).
    lora_slots: np.ndarray | None = None  # [B] int32

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_reqs(self) -> int:
        return len(self.kv_lens)

    @property
    def num_sampled(self) -> int:
        return len(self.logits_indices)

    @classmethod
    def empty(cls) -> HostBatch:
        """A batch of no tokens and no requests: padded to a tier, it is all padding (what a
        data-parallel rank with no work replays so every rank runs the same graph)."""
        i64, i32 = np.zeros(0, np.int64), np.zeros(0, np.int32)
        return cls(input_ids=i64, from_device_rows=i64, from_device_slots=i64, positions=i64,
                   slot_mapping=i64, cu_seqlens_q=np.zeros(1, np.int32), kv_lens=i32,
                   req_slots=i32, table_index=i32, table_value=i32, logits_indices=i64,
                   sample_slots=i64, sample_out_pos=i64)

    def padded(self, num_tokens: int, scratch_slot: int) -> HostBatch:
        """This batch with tokens up to ``num_tokens`` appended as padding (they write
        scratch block 0 and belong to no request); a batch of no requests gets one empty
        request (no tokens, ``kv_lens`` 0, the scratch slot's all-zero block table), so every
        backend sees a request to skip. An eager step run in the shapes the data-parallel
        ranks agreed on."""
        extra = num_tokens - self.num_tokens
        assert extra >= 0, "padding cannot shrink a batch"
        pad = np.zeros(extra, np.int64)
        changes = dict(input_ids=np.concatenate([self.input_ids, pad]),
                       positions=np.concatenate([self.positions, pad]),
                       slot_mapping=np.concatenate([self.slot_mapping, pad]))
        if self.num_reqs == 0:
            changes |= dict(cu_seqlens_q=np.zeros(2, np.int32), kv_lens=np.zeros(1, np.int32),
                            req_slots=np.full(1, scratch_slot, np.int32))
        return dataclasses.replace(self, **changes)

    @property
    def max_q_len(self) -> int:
        return int(np.diff(self.cu_seqlens_q).max(initial=0))

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


def set_host_lengths(meta: AttentionMetadata, host: HostBatch) -> None:
    """Give ``meta`` host copies of the lengths, for attention that reads them on the host
    (the torch reference backend; never a graph-safe one)."""
    meta.cu_seqlens_q_cpu = host.cu_seqlens_q.tolist()
    meta.kv_lens_cpu = host.kv_lens.tolist()


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
