"""The one-launch row argmax (``kernels.argmax``) vs ``torch.argmax``, through the Triton
interpreter."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("vocab", [1000, 3 * 4096 + 5])
def test_argmax(kernels, vocab):
    """One-launch row argmax = torch.argmax: first index on ties (many per row, across
    chunks), NaN wins, an all -inf row gives 0; counters are reset for the next launch."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.randint(0, 30, (5, vocab), generator=g).float()
    x[1, vocab - 3] = 31.0  # the maximum in the last (partial) chunk
    x[2, 7] = float("nan")
    x[2, vocab - 1] = float("nan")
    x[3] = float("-inf")
    for _ in range(2):
        got = kernels.argmax.argmax(x)
        assert got.dtype == torch.int64
        assert torch.equal(got, x.argmax(-1)), (got, x.argmax(-1))
        assert not kernels.argmax._counters(x.device).any()


@pytest.mark.parametrize("vocab", [1000, 3 * 4096 + 5])
def test_argmax_into_slots(kernels, vocab):
    """The answers also land in ``dest[slots]`` (the runtime's last_token), as index_copy_
    would put them; other entries of ``dest`` are left alone."""
    g = torch.Generator().manual_seed(vocab + 1)
    x = torch.randn(3, vocab, generator=g)
    dest = torch.full((8,), -7, dtype=torch.int64)
    slots = torch.tensor([6, 1, 4])
    got = kernels.argmax.argmax(x, dest, slots)
    want = x.argmax(-1)
    assert torch.equal(got, want)
    expect = torch.full((8,), -7, dtype=torch.int64)
    expect[slots] = want
    assert torch.equal(dest, expect)
    assert not kernels.argmax._counters(x.device).any()
