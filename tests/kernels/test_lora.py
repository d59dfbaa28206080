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


def _prologue_case(prologue: str, in_dim: int, g: torch.Generator):
    """The raw input rows of a prologue (``ref.lora_input``) and its keyword arguments."""
    t = 7
    x = torch.randn(t, in_dim, generator=g) * 3
    if prologue.startswith("norm"):
        kw = {"norm_weight": torch.rand(in_dim, generator=g) + 0.5, "eps": 1e-5}
        if prologue == "norm_residual":  # the shrink adds the residual itself
            kw["residual"] = torch.randn(t, in_dim, generator=g)
        return x, kw
    return x, {}


@pytest.mark.parametrize("prologue", ["plain", "norm", "norm_residual"])
@pytest.mark.parametrize("segments,in_dim,max_rank", [((24,), 40, 8), ((32, 16, 16), 48, 16),
                                                      ((20, 44), 300, 4), ((64, 16), 32, 32)])
def test_lora_add_matches_reference_with_each_prologue(kernels, prologue, segments, in_dim,
                                                       max_rank):
    """``lora_add`` (shrink over K ranges, then expand) against ``ref.lora_add`` with each
    prologue: base rows, an empty slot and two adapters of different ranks mixed, output
    column blocks that straddle segments, one K range and several."""
    _, y, a, b, tokens, ranks, scales = _slots_case(segments, in_dim, max_rank, in_dim)
    g = torch.Generator().manual_seed(7)
    x, kw = _prologue_case(prologue, in_dim, g)
    want = ref.lora_add(y.clone(), x, a, b, tokens, ranks, scales, segments, **kw)
    # Through the merged weights: y + scale * u @ (B @ A)^T, u the prologue's rows.
    u = ref.lora_input(x, **kw)
    row = 2  # slot 1
    merged = torch.cat([u[row] @ (b[1, sum(segments[:j]):sum(segments[:j + 1])]
                                  @ a[1, j * max_rank:(j + 1) * max_rank]).T
                        for j in range(len(segments))])
    torch.testing.assert_close(want[row], y[row] + 2.0 * merged, rtol=1e-4, atol=1e-4)
    # The shrink's partial sums add up to the reference's shrink on the adapted rows.
    parts = kernels.lora.lora_shrink(x, a, tokens, ranks, len(segments), **kw)
    assert parts.shape[1] == -(-in_dim // kernels.lora.shrink_split(in_dim, max_rank))
    adapted = (tokens >= 0) & (ranks[tokens.clamp(min=0).long()] > 0)
    s_ref = ref.lora_shrink(x, a, tokens, ranks, len(segments), **kw)
    for slot in (0, 1):
        rows = tokens == slot
        r = int(ranks[slot])
        for j in range(len(segments)):
            cols = slice(j * max_rank, j * max_rank + r)
            torch.testing.assert_close(parts[rows][:, :, cols].sum(1), s_ref[rows][:, cols],
                                       rtol=1e-4, atol=1e-4)
    got = kernels.lora.lora_add(y.clone(), x, a, b, tokens, ranks, scales, segments, **kw)
    # fp32 sums in another order: within a few ulps of the sums.
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got[~adapted], y[~adapted])


def test_many_ranges_and_padding_rows(kernels, monkeypatch):
    """A wide input (16 K ranges) at 1, 5 and 40 rows with a norm prologue; padding rows
    (slot -1, NaN inputs) stay as they are, to the bit."""
    lora = kernels.lora
    monkeypatch.setattr(lora, "SHRINK_RANGES", 16)
    _, _, a, b, _, ranks, scales = _slots_case((16, 8), 1024, 8, 3)
    g = torch.Generator().manual_seed(3)
    assert -(-1024 // lora.shrink_split(1024, 8)) == 16
    for t in (1, 5, 40):
        x = torch.randn(t, 1024, generator=g)
        y = torch.randn(t, 24, generator=g)
        tokens = torch.randint(-1, 3, (t,), generator=g, dtype=torch.int32)
        tokens[0] = 0
        tokens[-1] = -1 if t > 1 else 0
        if t > 1:
            x[-1] = float("nan")
        kw = {"norm_weight": torch.rand(1024, generator=g) + 0.5, "eps": 1e-6}
        want = ref.lora_add(y.clone(), x, a, b, tokens, ranks, scales, (16, 8), **kw)
        got = lora.lora_add(y.clone(), x, a, b, tokens, ranks, scales, (16, 8), **kw)
        keep = tokens >= 0
        torch.testing.assert_close(got[keep], want[keep], rtol=1e-4, atol=1e-4)
        assert torch.equal(got[~keep], y[~keep])


def test_lora_add_refuses_bad_input(kernels):
    _, y, a, b, tokens, ranks, scales = _slots_case((8,), 16, 4, 0)
    x = torch.randn(7, 16)
    with pytest.raises(ValueError, match="A is"):
        kernels.lora.lora_add(y, x[:, :8], a, b, tokens, ranks, scales, (8,))


@pytest.mark.parametrize("grid_target", [512, 1, "two"])
@pytest.mark.parametrize("segments,in_dim,max_rank", [((32, 16, 16), 48, 16),
                                                      ((20, 20), 300, 4), ((130,), 64, 8)])
def test_grouped_kernels_above_the_skinny_rows(kernels, monkeypatch, segments, in_dim,
                                                max_rank, grid_target):
    """Above ``GROUPED_ABOVE`` rows the shrink (plain rows) and the expand group rows by
    slot: 40 rows of three slots (one empty), base rows and a NaN padding row, in blocks of
    16 (the last partly filled); segments across column blocks (130 columns: two blocks).
    A program per row block; or (``GRID_TARGET`` 1) one program per slot and range or
    column block taking all three blocks in turn; or two programs of two blocks each, the
    last block past the rows. Against the references and the per-row kernels, and the
    rows of no adapter untouched, to the bit."""
    lora = kernels.lora
    if grid_target == "two":
        monkeypatch.setattr(kernels.lora_grouped, "_row_programs", lambda rows, others: (2, 2))
    else:
        monkeypatch.setattr(kernels.lora_grouped, "GRID_TARGET", grid_target)
    _, _, a, b, _, ranks, scales = _slots_case(segments, in_dim, max_rank, in_dim)
    g = torch.Generator().manual_seed(in_dim)
    t = 40
    x = torch.randn(t, in_dim, generator=g)
    y = torch.randn(t, sum(segments), generator=g)
    tokens = torch.randint(-1, 3, (t,), generator=g, dtype=torch.int32)
    tokens[:4] = torch.tensor([0, 1, 2, -1], dtype=torch.int32)
    tokens[-1] = -1
    x[-1] = float("nan")
    live = (tokens >= 0) & (tokens != 2)

    def run():
        s = lora.lora_shrink(x, a, tokens, ranks, len(segments))
        return s, lora.lora_expand(y.clone(), s, b, tokens, ranks, scales, segments)

    launched = []
    for name in ("grouped_shrink", "grouped_expand"):
        real = getattr(lora, name)
        monkeypatch.setattr(lora, name,
                            lambda *p, _real=real, _n=name, **kw: launched.append(_n)
                            or _real(*p, **kw))
    assert t > lora.GROUPED_ABOVE
    s, got = run()
    assert launched == ["grouped_shrink", "grouped_expand"]
    s_ref = ref.lora_shrink(x, a, tokens, ranks, len(segments))
    want = ref.lora_expand(y.clone(), s_ref, b, tokens, ranks, scales, segments)
    torch.testing.assert_close(got[live], want[live], rtol=1e-4, atol=1e-4)
    assert torch.equal(got[~live], y[~live])
    # The per-row kernels on the same rows: the same partial sums and outputs, up to the
    # order in which the products are summed.
    monkeypatch.setattr(lora, "GROUPED_ABOVE", t)
    s_rows, got_rows = run()
    for slot in (0, 1):
        rows = tokens == slot
        r = int(ranks[slot])
        for j in range(len(segments)):
            cols = slice(j * max_rank, j * max_rank + r)
            torch.testing.assert_close(s[rows][..., cols], s_rows[rows][..., cols],
                                       rtol=1e-5, atol=1e-5)
    # fp32 sums in another order (the interpreter's tl.dot is the host BLAS's, whose order
    # depends on the CPU): 300 products of ~1 differ by up to a few 1e-5.
    torch.testing.assert_close(got, got_rows, rtol=1e-4, atol=1e-4)


def test_grouped_row_programs_fill_the_grid_target(kernels, monkeypatch):
    """The row axis: a program per 16-row block while the grid stays within
    ``GRID_TARGET``, else an even share of the blocks per program, never none."""
    grouped = kernels.lora_grouped
    monkeypatch.setattr(grouped, "GRID_TARGET", 512)
    assert grouped._row_programs(64, 64) == (4, 1)  # o at 64 rows: 4 slots x 16 blocks
    assert grouped._row_programs(64, 512) == (1, 4)  # gate_up: 4 slots x 128 blocks
    assert grouped._row_programs(64, 192) == (2, 2)
    assert grouped._row_programs(2048, 48) == (10, 13)  # a prefill: 128 blocks
    assert grouped._row_programs(40, 4096) == (1, 3)
