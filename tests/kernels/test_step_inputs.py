"""The step-input gather (``kernels.step_inputs``) vs the torch path, through the Triton
interpreter."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("num_tokens,num_reqs,max_blocks", [(1, 1, 5), (5, 3, 37), (4, 0, 3)])
def test_gather_step_inputs(kernels, num_tokens, num_reqs, max_blocks):
    """One launch = the torch path: ids gathered from last_token ++ host ids, block-table
    rows from their slots, embedding rows of the ids (an id outside the vocabulary embeds as
    zeros instead of reading past the table)."""
    g = torch.Generator().manual_seed(num_tokens * 7 + max_blocks)
    vocab, hidden, slots = 50, 24, 6
    source = torch.randint(0, vocab, (slots + num_tokens,), generator=g)
    source[slots] = vocab + 3  # an out-of-range host id (token 0 reads it below)
    gather = torch.randint(0, slots + num_tokens, (num_tokens,), generator=g)
    gather[gather == slots] = 0
    gather[0] = slots
    tables = torch.randint(0, 1000, (slots, max_blocks), generator=g, dtype=torch.int32)
    req_slots = torch.randperm(slots, generator=g)[:num_reqs]
    emb = torch.randn(vocab, hidden, generator=g)
    ids = torch.full((num_tokens,), -1, dtype=torch.int64)
    bt = torch.full((num_reqs, max_blocks), -1, dtype=torch.int32)
    out = kernels.step_inputs.gather_step_inputs(source, gather, ids, tables, req_slots, bt, emb)
    assert torch.equal(ids, source[gather])
    assert torch.equal(bt, tables[req_slots])
    assert torch.equal(out[0], torch.zeros(hidden))
    assert torch.equal(out[1:], emb[ids[1:]])
