"""The skinny projection with its LoRA epilogue (``kernels.skinny_lora``) against the folded
reference (``ref.lora_linear``: the projection and the delta added in fp32, one rounding),
through the Triton interpreter: each prologue, with the row under test on slot -1, on an
empty slot or on a live adapter, alone and beside other rows; and the projection ops'
choice between folding and a separate expand (``kernels.ops``)."""

from __future__ import annotations

import pytest
import torch

from replaylm.kernels import ref

# prologue -> (K, segments, tile (BLOCK_N, BLOCK_K, warps)): K of several shrink ranges, a
# strip across segment bounds (norm: qkv-like), N not a multiple of BLOCK_N (plain), K chunks
# unrolled (plain) and in a loop (norm).
CASES = {"plain": (200, (24,), (16, 64, 4)), "norm": (100, (20, 6, 6), (8, 16, 4))}
MAX_RANK = 8
RANKS = (MAX_RANK, 5, 0)  # slot 2 is empty (its B holds garbage)
SLOT = {"base": -1, "empty": 2, "live": 1}


def _adapters(k: int, segments: tuple[int, ...], g: torch.Generator):
    n_slots, n = len(RANKS), sum(segments)
    a = torch.zeros(n_slots, len(segments) * MAX_RANK, k)
    b = torch.randn(n_slots, n, MAX_RANK, generator=g)
    for slot, r in enumerate(RANKS):
        for j in range(len(segments)):
            a[slot, j * MAX_RANK:j * MAX_RANK + r] = torch.randn(r, k, generator=g) * 0.3
        if r:
            b[slot, :, r:] = 0
    return a, b, torch.tensor(RANKS, dtype=torch.int32), torch.tensor([0.5, 2.0, 3.0])


def _case(prologue: str, rows: int, kind: str, seed: int = 0):
    """Inputs of one projection and its delta: row 0 on ``kind``'s slot, the others on slot
    0 and -1 (padding-like NaN rows are left to ``test_padding_rows``)."""
    k, segments, tile = CASES[prologue]
    g = torch.Generator().manual_seed(seed + rows)
    n = sum(segments)
    a, b, ranks, scales = _adapters(k, segments, g)
    tokens = torch.tensor([SLOT[kind], 0, -1][:rows], dtype=torch.int32)
    w = torch.randn(n, k, generator=g) * k**-0.5
    args: dict = {}
    x = torch.randn(rows, k, generator=g) * 2
    shrink_kw: dict = {}
    if prologue == "norm":
        args = {"residual": torch.randn(rows, k, generator=g),
                "norm_weight": torch.rand(k, generator=g) + 0.5, "eps": 1e-5}
        shrink_kw = dict(args)
    bias = torch.randn(n, generator=g) if prologue == "plain" else None
    config = (max(1, 1 << (rows - 1).bit_length()), *tile)
    return x, w, bias, args, shrink_kw, (a, b, tokens, ranks, scales, segments), config


def _run(lib, prologue, x, w, bias, args, lora, config=None):
    """The projection of ``prologue`` through ``lib`` (the references, or the kernels with
    ``config``); returns ``(y, new_residual or None)``."""
    kw = {"lora": lora} | ({"config": config} if config else {})
    if prologue == "norm":
        return lib.norm_linear(x, args["residual"], args["norm_weight"], args["eps"], w, bias,
                               **kw)
    return lib.linear(x, w, bias, **kw), None


class _Folded:
    """``kernels.skinny_lora``'s two projections under the references' names."""

    def __init__(self, mod) -> None:
        self.linear, self.norm_linear = mod.lora_linear, mod.lora_norm_linear


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("kind", ["base", "empty", "live"])
@pytest.mark.parametrize("prologue", ["plain", "norm"])
def test_folded_projection_matches_reference(kernels, prologue, kind, rows):
    x, w, bias, args, shrink_kw, (a, b, tokens, ranks, scales, segments), config = \
        _case(prologue, rows, kind)
    parts = kernels.lora.lora_shrink(x, a, tokens, ranks, len(segments), **shrink_kw)
    lora = ref.LoRADelta(parts, b, tokens, ranks, scales, segments)
    got, got_res = _run(_Folded(kernels.skinny_lora), prologue, x, w, bias, args, lora, config)
    # The reference shrinks with the torch rule (rows in the model dtype, no partial sums).
    want, want_res = _run(ref, prologue, x, w, bias, args,
                          ref.LoRAGroup(a, b, tokens, ranks, scales, segments, ref.lora_shrink))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    # Rows without an adapter are the plain skinny kernel's, to the bit; the new residual too.
    skinny = kernels.skinny
    if prologue == "norm":
        plain, plain_res = skinny.skinny_norm_linear(x, args["residual"], args["norm_weight"],
                                                     args["eps"], w, bias, config=config)
        assert torch.equal(got_res, plain_res) and torch.equal(got_res, want_res)
    else:
        plain = skinny.skinny_linear(x, w, bias, config=config)
    live = (tokens >= 0) & (ranks[tokens.clamp(min=0).long()] > 0)
    assert torch.equal(got[~live], plain[~live])
    assert live[0] == (kind == "live")
    if live.any():
        assert not torch.allclose(got[live], plain[live], atol=1e-3)
        # The delta is the merged weights': scale * u @ (B @ A)^T, u the prologue's rows.
        u = ref.lora_input(x, **shrink_kw)
        row = int(live.nonzero()[0])
        slot = int(tokens[row])
        merged = torch.cat([u[row] @ (b[slot, sum(segments[:j]):sum(segments[:j + 1])]
                                      @ a[slot, j * MAX_RANK:(j + 1) * MAX_RANK]).T
                            for j in range(len(segments))])
        torch.testing.assert_close(got[row], plain[row] + scales[slot] * merged, rtol=1e-4,
                                   atol=1e-4)


@pytest.mark.parametrize("rows,inter,tile", [(1, 12, (16, 64, 4)), (3, 16, (8, 16, 4))])
@pytest.mark.parametrize("prologue", ["plain", "norm"])
def test_folded_projection_with_silu_pairs(kernels, prologue, rows, inter, tile):
    """gate_up with its delta folded and SiLU·mul of each paired gate and up row in the
    epilogue: bit for bit ``silu_and_mul`` of the folded projection (I not a multiple of the
    half strip in the first case: its last strip is partly masked)."""
    g = torch.Generator().manual_seed(rows * 10 + inter)
    k, segments = 64, (inter, inter)
    a, b, ranks, scales = _adapters(k, segments, g)
    tokens = torch.tensor([1, 0, -1][:rows], dtype=torch.int32)
    x, w = torch.randn(rows, k, generator=g), torch.randn(2 * inter, k, generator=g) * 0.3
    bias = torch.randn(2 * inter, generator=g) if prologue == "plain" else None
    config = (max(1, 1 << (rows - 1).bit_length()), *tile)
    norm = ({"residual": torch.randn(rows, k, generator=g),
             "norm_weight": torch.rand(k, generator=g) + 0.5, "eps": 1e-5}
            if prologue == "norm" else {})
    parts = kernels.lora.lora_shrink(x, a, tokens, ranks, len(segments), **norm)
    delta = ref.LoRADelta(parts, b, tokens, ranks, scales, segments)
    folded = kernels.skinny_lora
    if prologue == "norm":
        nargs = (norm["residual"], norm["norm_weight"], norm["eps"])
        y, want_res = folded.lora_norm_linear(x, *nargs, w, bias, delta, config)
        got, got_res = folded.lora_norm_linear(x, *nargs, w, bias, delta, config,
                                               silu_pairs=True)
        assert torch.equal(got_res, want_res)
    else:
        y = folded.lora_linear(x, w, bias, delta, config)
        got = folded.lora_linear(x, w, bias, delta, config, silu_pairs=True)
    assert got.shape == (rows, inter)
    assert torch.equal(got, kernels.elementwise.silu_and_mul(y))


def test_padding_rows(kernels):
    """Padding rows (slot -1, NaN inputs) beside a live row: stored as the plain kernel
    stores them, and the live row is untouched by them."""
    x, w, bias, args, shrink_kw, (a, b, tokens, ranks, scales, segments), config = \
        _case("plain", 3, "live", seed=5)
    x[2] = float("nan")
    parts = kernels.lora.lora_shrink(x, a, tokens, ranks, len(segments))
    lora = ref.LoRADelta(parts, b, tokens, ranks, scales, segments)
    got = kernels.skinny_lora.lora_linear(x, w, bias, lora, config)
    plain = kernels.skinny.skinny_linear(x, w, bias, config=config)
    assert torch.equal(got[2].isnan(), plain[2].isnan())
    want = ref.lora_linear(x[:2], w, bias, ref.LoRADelta(parts[:2], b, tokens[:2], ranks,
                                                          scales, segments))
    torch.testing.assert_close(got[:2], want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("decision", ["whole", "split", "unfused"])
def test_ops_fold_only_whole_k_tiles(kernels, monkeypatch, decision):
    """``kernels.ops`` folds the delta into a whole-K skinny tile, and otherwise runs the
    projection as without LoRA and adds the delta after it (``lora_expand``): the folded
    rule (one rounding) or the separate one, each against its reference."""
    ops = kernels.ops
    x, w, bias, args, shrink_kw, (a, b, tokens, ranks, scales, segments), config = \
        _case("norm", 3, "live", seed=9)
    config = {"whole": config, "split": (*config, 2), "unfused": None}[decision]
    monkeypatch.setattr(ops, "_few_rows", lambda t: 0 < t.shape[0] <= kernels.skinny.MAX_M)
    monkeypatch.setattr(kernels.tuner, "choose", lambda key, weight, unfused, fused: config)
    launched = []
    real = kernels.skinny_lora._launch
    monkeypatch.setattr(kernels.skinny_lora, "_launch",
                        lambda *p, **kw: launched.append(1) or real(*p, **kw))
    group = ref.LoRAGroup(a, b, tokens, ranks, scales, segments, kernels.lora.lora_shrink)
    got, new_res = ops.norm_linear(x, args["residual"], args["norm_weight"], args["eps"], w,
                                   bias, lora=group)
    assert bool(launched) == (decision == "whole")
    if decision == "whole":
        want, _ = ref.norm_linear(x, args["residual"], args["norm_weight"], args["eps"], w,
                                  bias, lora=group)
    else:
        y, _ = ref.norm_linear(x, args["residual"], args["norm_weight"], args["eps"], w, bias)
        s_ref = ref.lora_shrink(x, a, tokens, ranks, len(segments), **shrink_kw)
        want = ref.lora_expand(y, s_ref, b, tokens, ranks, scales, segments)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(new_res, x + args["residual"], rtol=0, atol=0)
