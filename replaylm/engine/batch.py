"""The one batch format (DESIGN.md): every forward pass takes one front-packed batch."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from replaylm.attention.backend import BLOCK_SIZE, AttentionMetadata
from replaylm.engine.scheduler import SchedulerOutput


@dataclass
class ForwardBatch:
    """Device tensors of one step plus the host facts the runner needs afterwards."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata  # cu_seqlens_q, kv_lens, block_table, slot_mapping
    logits_indices: torch.Tensor  # [L] int64: packed rows whose logits are sampled
    sample_slots: torch.Tensor  # [L] int64: request slot of each sampled row
    sample_out_pos: torch.Tensor  # [L] int64: output index of the token each row samples
    sample_slots_cpu: list[int]
    num_tokens: int
    num_reqs: int


def build_batch(
    out: SchedulerOutput,
    last_token: torch.Tensor,
    max_blocks: int,
    device: torch.device,
    host_attn_lengths: bool,
) -> ForwardBatch:
    """Front-pack the scheduled requests into one batch (no padding; graphs pad later).

    A decode token that is the request's latest sample is not written from the host: its id
    is gathered on the device from ``last_token[slot]`` where the sampler left it, so building
    step N+1 never needs step N's tokens on the host (the overlap-ready convention).
    """
    ids: list[int] = []
    from_device: list[int] = []  # packed rows fed from last_token
    from_slot: list[int] = []
    positions: list[np.ndarray] = []
    slot_mapping: list[np.ndarray] = []
    cu = [0]
    kv_lens: list[int] = []
    table = torch.zeros((len(out.scheduled), max_blocks), dtype=torch.int32)
    logits_idx: list[int] = []
    slots: list[int] = []
    out_pos: list[int] = []
    for req in out.newly_slotted:
        req.device_token_slot = -1  # whatever last_token[slot] holds belongs to someone else
    for row, sr in enumerate(out.scheduled):
        req, start, n = sr.request, sr.start, sr.num_new_tokens
        base = len(ids)
        ids.extend(req.all_token_ids[start : start + n])
        last_out = req.num_tokens - 1
        if req.output_token_ids and start <= last_out < start + n \
                and req.device_token_slot == req.slot:
            from_device.append(base + last_out - start)
            from_slot.append(req.slot)
        pos = np.arange(start, start + n)
        positions.append(pos)
        slot_mapping.append(np.asarray(req.block_ids)[pos // BLOCK_SIZE] * BLOCK_SIZE
                            + pos % BLOCK_SIZE)
        cu.append(len(ids))
        kv_lens.append(start + n)
        table[row, : len(req.block_ids)] = torch.tensor(req.block_ids, dtype=torch.int32)
        if sr.sample:
            req.device_token_slot = req.slot  # the sampler writes last_token[slot]
            logits_idx.append(len(ids) - 1)
            slots.append(req.slot)
            out_pos.append(req.num_output_tokens)

    def dev(values, dtype=torch.int64) -> torch.Tensor:
        if isinstance(values, list) and values and isinstance(values[0], np.ndarray):
            values = np.concatenate(values)
        return torch.as_tensor(values, dtype=dtype).to(device, non_blocking=True)

    input_ids = dev(ids)
    if from_device:
        input_ids[dev(from_device)] = last_token[dev(from_slot)]
    meta = AttentionMetadata(
        cu_seqlens_q=dev(cu, torch.int32),
        kv_lens=dev(kv_lens, torch.int32),
        block_table=table.to(device, non_blocking=True),
        slot_mapping=dev(slot_mapping),
        num_tokens=len(ids),
        num_reqs=len(kv_lens),
        max_q_len=max(sr.num_new_tokens for sr in out.scheduled),
        max_kv_len=max(kv_lens),
        cu_seqlens_q_cpu=cu if host_attn_lengths else None,
        kv_lens_cpu=kv_lens if host_attn_lengths else None,
    )
    return ForwardBatch(
        input_ids=input_ids,
        positions=dev(positions),
        meta=meta,
        logits_indices=dev(logits_idx),
        sample_slots=dev(slots),
        sample_out_pos=dev(out_pos),
        sample_slots_cpu=slots,
        num_tokens=len(ids),
        num_reqs=len(kv_lens),
    )
