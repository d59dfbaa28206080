"""A step's device-side inputs in one launch: input ids, block table and embedded rows.

A graphed step starts from what the host copied in one go (``graphs.buffers``): per token an
index into ``last_token ++ host_ids``, per request its slot. With torch ops that takes three
graph nodes (two index_selects and the embedding lookup), each a whole kernel boundary of
about 2 µs at batch 1 on an H200. Here program ``t < T`` looks up token ``t``'s id, stores it
and copies its embedding row; program ``T + r`` copies request ``r``'s block-table row from
its slot's row. Ids outside the vocabulary embed as zeros instead of reading past the table
(the engine rejects such prompts before they get here).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replaylm.kernels import pdl
from replaylm.kernels.pdl import wait_for_previous


@triton.jit(do_not_specialize=["num_tokens", "vocab", "max_blocks"])
def _step_inputs_kernel(source_ptr, gather_ptr, ids_ptr, emb_ptr, hidden_ptr, tables_ptr,
                        req_slots_ptr, bt_ptr, num_tokens, vocab, max_blocks, stride_emb,
                        stride_hidden, stride_tables, stride_bt, HIDDEN: tl.constexpr,
                        BLOCK_H: tl.constexpr, BLOCK_B: tl.constexpr, USE_PDL: tl.constexpr):
    pid = tl.program_id(0)
    wait_for_previous(USE_PDL)  # last_token was written by the previous step's sampling
    if pid < num_tokens:
        tok = tl.load(source_ptr + tl.load(gather_ptr + pid))
        tl.store(ids_ptr + pid, tok)
        cols = tl.arange(0, BLOCK_H)
        ok = (cols < HIDDEN) & (tok >= 0) & (tok < vocab)
        row = tl.load(emb_ptr + tok * stride_emb + cols, mask=ok, other=0.0)
        tl.store(hidden_ptr + pid.to(tl.int64) * stride_hidden + cols, row, mask=cols < HIDDEN)
    else:
        r = (pid - num_tokens).to(tl.int64)
        slot = tl.load(req_slots_ptr + r).to(tl.int64)
        for b0 in range(0, max_blocks, BLOCK_B):
            cols = b0 + tl.arange(0, BLOCK_B)
            ok = cols < max_blocks
            blocks = tl.load(tables_ptr + slot * stride_tables + cols, mask=ok)
            tl.store(bt_ptr + r * stride_bt + cols, blocks, mask=ok)


def gather_step_inputs(token_source: torch.Tensor, gather: torch.Tensor, input_ids: torch.Tensor,
                       slot_tables: torch.Tensor, req_slots: torch.Tensor,
                       block_table: torch.Tensor, embedding: torch.Tensor) -> torch.Tensor:
    """``input_ids[:] = token_source[gather]``, ``block_table[:] = slot_tables[req_slots]``
    and returns ``embedding[input_ids]`` (a fresh ``[T, H]`` tensor), in one launch."""
    num_tokens, num_reqs = gather.shape[0], req_slots.shape[0]
    vocab, hidden = embedding.shape
    assert input_ids.shape == (num_tokens,) and block_table.shape[0] == num_reqs
    assert block_table.shape[1] == slot_tables.shape[1]
    assert embedding.stride(1) == 1 and slot_tables.stride(1) == 1 and block_table.stride(1) == 1
    out = embedding.new_empty(num_tokens, hidden)
    if num_tokens + num_reqs == 0:
        return out
    max_blocks = slot_tables.shape[1]
    _step_inputs_kernel[(num_tokens + num_reqs,)](
        token_source, gather, input_ids, embedding, out, slot_tables, req_slots, block_table,
        num_tokens, vocab, max_blocks, embedding.stride(0), out.stride(0),
        slot_tables.stride(0), block_table.stride(0), HIDDEN=hidden,
        BLOCK_H=triton.next_power_of_2(hidden),
        BLOCK_B=min(1024, triton.next_power_of_2(max(max_blocks, 1))),
        USE_PDL=pdl.ENABLED, num_warps=4, **pdl.LAUNCH,
    )
    return out
