"""The one-launch sampler (``kernels.sample``) vs its torch reference ``counter_rng.race``,
through the Triton interpreter."""

from __future__ import annotations

import pytest
import torch

from replaylm.kernels import counter_rng as rng


def _case(rows: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 3
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.6, 0.0, 0.3, 2.5, 1.0] * 2)
    seed_keys = torch.tensor([rng.seed_key(s) for s in range(100, 116)], dtype=torch.int64)
    # Distinct slots (dest[slots] is then well defined), a random and a greedy one first.
    slots = torch.cat([torch.tensor([1, 0]), 2 + torch.randperm(14, generator=g)])[:rows]
    out_pos = torch.randint(0, 5000, (rows,), generator=g)
    return logits, temperature, seed_keys, slots, out_pos


@pytest.mark.parametrize("vocab", [1000, 2 * 4096 + 17])
def test_sample_matches_the_race(kernels, vocab):
    """Greedy rows take the argmax, the others the race on the counter-based uniforms: the
    reference's tokens (the uniforms computed in uint32 on the fly equal the int64 ones), the
    answers also in ``dest[slots]``, the arrival counters reset."""
    logits, temperature, seed_keys, slots, out_pos = _case(12, vocab, vocab)
    want = rng.race(logits, temperature[slots], seed_keys[slots], out_pos,
                    rng.vocab_hash(vocab, "cpu"))
    dest = torch.full((17,), -1, dtype=torch.int64)
    got = kernels.sample.sample(logits, slots, out_pos, temperature, seed_keys, dest=dest)
    assert torch.equal(got, want), (got, want)
    assert torch.equal(dest[slots], want)
    assert not kernels.argmax._counters(logits.device).any()
    # Not the argmax everywhere: the random rows do draw.
    hot = temperature[slots] > 0
    assert (got[hot] != logits.argmax(-1)[hot]).any()


def test_sample_threshold(kernels):
    """Entries below a row's threshold never win its race; a greedy row ignores it."""
    vocab = 3000
    logits, temperature, seed_keys, slots, out_pos = _case(10, vocab, 7)
    scaled = logits / torch.where(temperature[slots] == 0, 1.0, temperature[slots])[:, None]
    threshold = scaled.topk(5, dim=-1).values[:, -1]  # top-5
    want = rng.race(logits, temperature[slots], seed_keys[slots], out_pos,
                    rng.vocab_hash(vocab, "cpu"), threshold)
    got = kernels.sample.sample(logits, slots, out_pos, temperature, seed_keys, threshold)
    assert torch.equal(got, want)
    top5 = scaled.topk(5, dim=-1).indices
    assert all(int(t) in top5[i].tolist() for i, t in enumerate(got))


def test_sample_nan_and_ties(kernels):
    """As torch.argmax on greedy rows: first index on ties, NaN wins; a NaN logit wins a race
    too (its key is NaN, which torch's argmin returns)."""
    vocab = 4096 + 9
    logits = torch.zeros(3, vocab)
    logits[1, vocab - 2] = float("nan")
    logits[2, 5] = float("nan")
    temperature = torch.tensor([0.0, 0.0, 1.0])
    seed_keys = torch.tensor([rng.seed_key(1)] * 3, dtype=torch.int64)
    slots, out_pos = torch.arange(3), torch.zeros(3, dtype=torch.int64)
    got = kernels.sample.sample(logits, slots, out_pos, temperature, seed_keys)
    want = rng.race(logits, temperature, seed_keys, out_pos, rng.vocab_hash(vocab, "cpu"))
    assert got.tolist() == want.tolist() == [0, vocab - 2, 5]
