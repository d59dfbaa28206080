"""Split-K tiles of the skinny matmul (``kernels.skinny_split``) through the Triton
interpreter: every split-K candidate, with the plain, RMSNorm (with and without a residual)
and SiLU·mul prologues, FP8 row scales and biases, against ``kernels.ref``; ranges that end
in masked chunks, ranges streamed in a loop; the tuner's candidates and tie rule."""

from __future__ import annotations

import pytest
import torch

from replaylm.kernels import ref


def _weights(n: int, k: int, fp8: bool, g: torch.Generator):
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)
    return ref.quantize_fp8(w) if fp8 else (w, None)


def _split_tiles(kernels, m: int, k: int, fp8: bool) -> list[tuple[int, ...]]:
    dtype = torch.float8_e4m3fn if fp8 else None
    return [c for c in kernels.skinny.candidate_configs(m, k, dtype) if len(c) == 5]


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("m", [2, 4, 8])
def test_every_split_candidate(kernels, m, fp8):
    """Each split-K tile the tuner times, all three prologues, against the reference;
    repeatable to the bit (a fixed reduction order)."""
    k = {1: 4096, 2: 2048, 4: 1024, 8: 512}[m] * (2 if fp8 else 1)
    n = 40  # not a multiple of any BLOCK_N: the last strip is masked
    g = torch.Generator().manual_seed(m + 10 * fp8)
    tiles = _split_tiles(kernels, m, k, fp8)
    assert len(tiles) == len(kernels.skinny_split.SPLIT_CANDIDATES[m])
    assert all(c[4] > 1 for c in tiles)
    x, res = torch.randn(m, k, generator=g), torch.randn(m, k, generator=g)
    gate_up, nw = torch.randn(m, 2 * k, generator=g), torch.randn(k, generator=g)
    w, scale = _weights(n, k, fp8, g)
    b = torch.randn(n, generator=g)
    skinny = kernels.skinny
    want = ref.linear(x, w, b, scale=scale)
    want_y, want_res = ref.norm_linear(x, res, nw, 1e-6, w, scale=scale)
    want_silu = ref.silu_linear(gate_up, w, scale=scale)
    for cfg in tiles:
        got = skinny.skinny_linear(x, w, b, config=cfg, scale=scale)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=f"tile {cfg}")
        assert torch.equal(got, skinny.skinny_linear(x, w, b, config=cfg, scale=scale))
        y, new_res = skinny.skinny_norm_linear(x, res, nw, 1e-6, w, config=cfg, scale=scale)
        torch.testing.assert_close(new_res, want_res, rtol=0, atol=0)
        torch.testing.assert_close(y, want_y, rtol=1e-4, atol=1e-4, msg=f"norm tile {cfg}")
        got = skinny.skinny_silu_linear(gate_up, w, config=cfg, scale=scale)
        torch.testing.assert_close(got, want_silu, rtol=1e-4, atol=1e-4, msg=f"silu {cfg}")


# (config, what it exercises) at k = 100, BLOCK_K 8 or 16: uneven last ranges (masked
# chunks, EVEN_K off), ranges longer than MAX_UNROLL chunks (the loop), many ranges.
SMALL_TILES = [(4, 8, 16, 4, 2),   # 7 chunks: ranges of 4 and 3 (one masked chunk)
               (4, 8, 16, 4, 3),   # 7 chunks: ranges of 3, 3 and 1
               (4, 16, 8, 4, 2),   # 13 chunks: two ranges of 7, streamed in a loop
               (8, 4, 8, 4, 13)]   # one chunk per range


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("cfg", SMALL_TILES)
def test_split_ranges_and_prologues(kernels, cfg, fp8):
    m, n, k = 3, 37, 100
    g = torch.Generator().manual_seed(cfg[4] * 7 + cfg[2] + fp8)
    skinny = kernels.skinny
    x, res = torch.randn(m, k, generator=g), torch.randn(m, k, generator=g)
    nw = torch.randn(k, generator=g)
    w, scale = _weights(n, k, fp8, g)
    b = torch.randn(n, generator=g)
    out = torch.full((m, n), float("nan"))
    assert skinny.skinny_linear(x, w, b, config=cfg, out=out, scale=scale) is out
    torch.testing.assert_close(out, ref.linear(x, w, b, scale=scale), rtol=1e-4, atol=1e-4)
    for r in (res, None):  # the norm's sum of squares is split too; no residual: input back
        y, new_res = skinny.skinny_norm_linear(x, r, nw, 1e-6, w, b, config=cfg, scale=scale)
        want_y, want_res = ref.norm_linear(x, r, nw, 1e-6, w, b, scale=scale)
        torch.testing.assert_close(new_res, want_res, rtol=0, atol=0)
        torch.testing.assert_close(y, want_y, rtol=1e-4, atol=1e-4)
        if r is None:
            assert new_res is x
    gate_up = torch.randn(m, 2 * k, generator=g)
    torch.testing.assert_close(skinny.skinny_silu_linear(gate_up, w, config=cfg, scale=scale),
                               ref.silu_linear(gate_up, w, scale=scale), rtol=1e-4, atol=1e-4)


def test_split_chunks_and_candidates(kernels):
    """Ranges hold whole chunks and none is empty; a split tile whose ``K`` fits in one
    range is not a candidate; the whole-K tiles come first, unchanged."""
    split = kernels.skinny_split
    assert split.split_chunks(4096, 1024, 2) == (2, 2)
    assert split.split_chunks(14336, 2048, 8) == (1, 7)
    assert split.split_chunks(100, 16, 2) == (4, 2)
    assert split.split_chunks(100, 16, 3) == (3, 3)
    assert split.split_chunks(512, 1024, 4) == (1, 1)
    skinny = kernels.skinny
    fp8 = torch.float8_e4m3fn
    for m in (1, 2, 4, 8):
        for dtype, whole in ((None, skinny.CANDIDATES), (fp8, skinny.CANDIDATES_FP8)):
            cands = skinny.candidate_configs(m, 8192, dtype)
            assert [c[1:] for c in cands[:len(whole[m])]] == [t for t in whole[m]]
            assert len(cands) == len(whole[m]) + len(split.SPLIT_CANDIDATES.get(m, []))
    assert _split_tiles(kernels, 1, 8192, False) == []  # one row: whole-K tiles only
    assert _split_tiles(kernels, 2, 512, True) == []  # one 512-byte chunk: nothing to split
    assert split.SPLIT_CANDIDATES_FP8[2] == [(bn, 2 * bk, w, s)
                                             for bn, bk, w, s in split.SPLIT_CANDIDATES[2]]


def test_block_m_below_rows_is_refused(kernels):
    x, w = torch.randn(3, 32), torch.randn(8, 32)
    with pytest.raises(ValueError, match="BLOCK_M=2 < 3 rows"):
        kernels.skinny.skinny_linear(x, w, config=(2, 8, 16, 4, 2))


def test_tuner_prefers_whole_k_on_near_ties(kernels, monkeypatch):
    """A split-K tile (two launches) is chosen only when it beats every whole-K tile by more
    than ``TIE``; the digest covers the split candidates."""
    tuner = kernels.tuner
    tiles = [(1, 4, 1024, 4), (1, 8, 1024, 4, 2), (1, 16, 1024, 8, 4)]
    monkeypatch.setattr(kernels.skinny, "candidate_configs",
                        lambda m, k, weight_dtype=None: tiles)
    monkeypatch.setattr(tuner, "graph_time_us", lambda fn, weights: fn(weights[0]))

    def run(times):
        return tuner._tune(("plain-fp8", 1, 4096, 4096), [None], lambda w: 20.0,
                           lambda cfg, w: times[cfg])[0]

    assert run({tiles[0]: 7.0, tiles[1]: 6.9, tiles[2]: 5.0}) == tiles[2]
    assert run({tiles[0]: 7.0, tiles[1]: 6.9, tiles[2]: 6.95}) == tiles[0]
    assert run({tiles[0]: 7.0, tiles[1]: 6.0, tiles[2]: 6.05}) == tiles[1]  # fewer warps
    tuner.kernels_revision.cache_clear()
    first = tuner.kernels_revision()
    monkeypatch.setitem(kernels.skinny_split.SPLIT_CANDIDATES, 1, [(8, 512, 4, 16)])
    tuner.kernels_revision.cache_clear()
    assert tuner.kernels_revision() != first
    tuner.kernels_revision.cache_clear()
