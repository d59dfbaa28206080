"""The LoRA shrink/expand kernels (``kernels.lora``) vs their torch references, through the
Triton interpreter: rows of several slots, base rows (-1) and an empty slot (rank 0) in one
batch; fused qkv-like segments; adapters of a rank below the slots'."""

from __future__ import annotations

import pytest
import torch

from replaylm.kernels import ref


def _slots_case(segments, in_dim, max_rank, seed):
    g = torch.Generator().manual_seed(seed)
    num_slots, t = 3, 7
    s_count = len(segments)
    a = torch.zeros(num_slots, s_count * max_rank, in_dim)
    b = torch.zeros(num_slots, sum(segments), max_rank)
    ranks = torch.tensor([max_rank, max_rank // 2 + 1, 0], dtype=torch.int32)  # 2: empty
    for slot in range(num_slots):
        r = int(ranks[slot])
        for j in range(s_count):
            a[slot, j * max_rank: j * max_rank + r] = torch.randn(r, in_dim, generator=g)
        b[slot, :, :r] = torch.randn(sum(segments), r, generator=g)
    b[2] = torch.randn(sum(segments), max_rank, generator=g)  # garbage in an empty slot
    x = torch.randn(t, in_dim, generator=g)
    y = torch.randn(t, sum(segments), generator=g)
    tokens = torch.tensor([0, -1, 1, 2, 0, 1, -1], dtype=torch.int32)
    scales = torch.tensor([0.5, 2.0, 3.0])
    return x, y, a, b, tokens, ranks, scales


@pytest.mark.parametrize("segments,in_dim,max_rank", [((24,), 40, 8), ((32, 16, 16), 48, 16),
                                                      ((20, 20), 300, 4)])
def test_shrink_expand_match_reference(kernels, segments, in_dim, max_rank):
    x, y, a, b, tokens, ranks, scales = _slots_case(segments, in_dim, max_rank, in_dim)
    s_ref = ref.lora_shrink(x, a, tokens, ranks, len(segments))
    want = ref.lora_expand(y.clone(), s_ref, b, tokens, ranks, scales, segments)
    s = kernels.lora.lora_shrink(x, a, tokens, ranks, len(segments))
    got = kernels.lora.lora_expand(y.clone(), s, b, tokens, ranks, scales, segments)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # Base rows and the empty slot's rows are untouched, to the bit.
    untouched = (tokens < 0) | (tokens == 2)
    assert torch.equal(got[untouched], y[untouched])
    # The delta is what the merged weights give: y + scale * x @ (B @ A)^T per segment.
    row = 2  # slot 1, rank max_rank // 2 + 1
    merged, start = [], 0
    for j, width in enumerate(segments):
        a_j = a[1, j * max_rank:(j + 1) * max_rank]
        merged.append(x[row] @ (b[1, start:start + width] @ a_j).T)
        start += width
    torch.testing.assert_close(got[row], y[row] + 2.0 * torch.cat(merged), rtol=1e-4,
                               atol=1e-4)


def test_no_rows(kernels):
    x, y, a, b, tokens, ranks, scales = _slots_case((8,), 16, 4, 0)
    s = kernels.lora.lora_shrink(x[:0], a, tokens[:0], ranks)
    assert kernels.lora.lora_expand(y[:0], s, b, tokens[:0], ranks, scales, (8,)).shape == (0, 8)
