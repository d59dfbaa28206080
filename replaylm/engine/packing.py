"""Front-packing the scheduled requests into a ``HostBatch`` (``replaylm.batch``)."""

from __future__ import annotations

import numpy as np

from replaylm.batch import BLOCK_SIZE, HostBatch
from replaylm.engine.scheduler import SchedulerOutput

#: Runs of up to this many tokens (verifies, short prompt chunks) get their KV slots in plain
#: Python: numpy's cost per call would be most of their packing.
SMALL_RUN = 32


def build_host_batch(out: SchedulerOutput, max_blocks: int, pad_verify_to: int = 0,
                     max_model_len: int | None = None) -> HostBatch:
    """Front-pack the scheduled requests on the host.

    ``pad_verify_to`` (the ``padded`` verify layout: ``num_speculative_tokens + 1``): in a
    step where some request verifies drafts, every decoding request's query rows are padded
    to that many tokens. Padding rows sit after the request's real tokens, at the next
    positions (below ``max_model_len``), write the scratch block 0 and are never sampled: the
    real rows attend causally and never see them. ``HostBatch.layout_pad_tokens`` counts them.

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
    draft_next: list[int] = []
    seg_start: list[int] = []
    pen_rows: list[int] = []  # penalties: (sampled row, draft before it) pairs
    pen_tokens: list[int] = []
    lora_slots: list[int] = []  # each request's adapter slot (-1: base model)
    verify = False
    pad_to = pad_verify_to if pad_verify_to and any(
        sr.drafts and sr.sample for sr in out.scheduled) else 0
    layout_pad = 0
    # Plain Python lists, one numpy conversion each at the end: at 256 decoding requests this
    # loop is per-step host time, and small numpy arrays per request cost more than they save.
    for sr in out.scheduled:
        req, start, n = sr.request, sr.start, sr.num_new_tokens
        base = len(ids)
        end = start + n
        drafts = sr.drafts
        if drafts:  # a verify: the last known token, then the drafts (past the known tokens)
            ids.extend(req.token_slice(start, end - len(drafts)))
            ids.extend(drafts)
        else:
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
        elif n <= SMALL_RUN:
            positions.extend(range(start, end))
            slots.extend([blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                          for p in range(start, end)])
        else:
            pos = np.arange(start, end)
            b = np.asarray(blocks, dtype=np.int64)
            positions.extend(range(start, end))
            slots.extend((b[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE).tolist())
        pad = 0
        if pad_to and sr.sample and n == 1 + len(drafts):  # a decoding request
            pad = max(0, min(pad_to - n, (max_model_len or end + pad_to) - end))
            ids.extend([0] * pad)
            positions.extend(range(end, end + pad))
            slots.extend([0] * pad)  # the scratch block
            layout_pad += pad
        cu.append(len(ids))
        kv_lens.append(end + pad)
        req_slots.append(req.slot)
        lora_slots.append(req.lora_slot)
        real_end = len(ids) - pad
        if sr.sample and drafts:
            # k + 1 rows sample output positions num_generated .. + k; the request's next
            # input is resolved on the host (its last_token entry holds any of the rows).
            verify = True
            req.device_token_slot = -1
            k = len(drafts)
            first = len(logits_idx)
            logits_idx.extend(range(real_end - k - 1, real_end))
            sample_slots.extend([req.slot] * (k + 1))
            out_pos.extend(range(req.num_generated, req.num_generated + k + 1))
            draft_next.extend(drafts)
            draft_next.append(-1)
            seg_start.extend([first] * (k + 1))
            if req.sampling_params.uses_penalties:  # row j also counts drafts 0 .. j-1
                for j in range(1, k + 1):
                    pen_rows.extend([first + j] * j)
                    pen_tokens.extend(drafts[:j])
        elif sr.sample:
            req.device_token_slot = req.slot  # the sampler writes last_token[slot]
            seg_start.append(len(logits_idx))
            logits_idx.append(real_end - 1)
            sample_slots.append(req.slot)
            out_pos.append(req.num_generated)
            draft_next.append(-1)
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
        draft_next=np.asarray(draft_next, dtype=i64) if verify else None,
        seg_start=np.asarray(seg_start, dtype=i64) if verify else None,
        layout_pad_tokens=layout_pad,
        draft_count_rows=np.asarray(pen_rows, dtype=i64) if pen_rows else None,
        draft_count_tokens=np.asarray(pen_tokens, dtype=i64) if pen_rows else None,
        lora_slots=(np.asarray(lora_slots, dtype=i32)
                    if any(s >= 0 for s in lora_slots) else None),
    )
