"""The structured-output bitmask kernel against its torch reference (Triton interpreter)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.helpers import interpreter_active

pytestmark = pytest.mark.skipif(not interpreter_active(), reason="interpreter not active")


def test_bitmask_kernel_matches_reference():
    from replaylm.kernels.bitmask import apply_token_bitmask as kernel
    from replaylm.sampling.bitmask import apply_token_bitmask as ref
    from replaylm.sampling.bitmask import bitmask_words

    g = torch.Generator().manual_seed(0)
    vocab, slots_n, rows = 4100, 5, 6  # two chunks, the second ragged
    mask = torch.randint(-2**31, 2**31 - 1, (slots_n + 1, bitmask_words(vocab)), generator=g,
                         dtype=torch.int64).to(torch.int32)
    flags = torch.tensor([1, 0, 1, 0, 1, 0], dtype=torch.int32)  # scratch slot 5 off
    slots = torch.tensor([0, 1, 2, 5, 4, 0], dtype=torch.int64)
    logits = torch.randn(rows, vocab, generator=g)
    want = ref(logits.clone(), mask, flags, slots)
    got = kernel(logits.clone(), mask, flags, slots)
    assert torch.equal(got, want)
    assert torch.equal(got[1], logits[1]) and torch.isinf(got[0]).any()
