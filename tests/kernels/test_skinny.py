"""The skinny (few-row) projection kernels of ``kernels.skinny`` (plain, norm and SiLU
prologues), the layers' dispatch to them (``kernels.ops``), and the tuner's digest and tie
rule, through the Triton interpreter. The references are ``kernels.ref``'s ops with the
matmul accumulated in fp32 (as the kernel does)."""

from __future__ import annotations

import pytest
import torch

from replaylm.kernels import ref


def linear_fp32(x, w, b=None):
    """``ref.linear`` accumulated in fp32, rounded to ``x``'s dtype."""
    return ref.linear(x.float(), w.float(), None if b is None else b.float()).to(x.dtype)


def norm_linear_fp32(x, residual, norm_weight, eps, w, b=None):
    normed, new_res = ref.add_rms_norm(x, residual, norm_weight, eps)
    return linear_fp32(normed, w, b), new_res


@pytest.mark.parametrize("m,n,k,bias", [(1, 24, 40, False), (3, 37, 64, True),
                                        (8, 16, 100, False), (9, 8, 16, False)])
def test_skinny_linear(kernels, m, n, k, bias):
    """Few-row matmul (the decode projections) vs fp32 torch; more rows than MAX_M take
    F.linear. The layers' ``linear`` is this kernel."""
    g = torch.Generator().manual_seed(m * 100 + n)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    got = kernels.skinny.skinny_linear(x, w, b)
    torch.testing.assert_close(got, linear_fp32(x, w, b), rtol=1e-5, atol=1e-4)
    # Non-contiguous rows (a flattened view) and an explicit tile config.
    wide = torch.randn(m, 2 * k, generator=g)[:, :k]
    got = kernels.skinny.skinny_linear(wide, w, b, config=(16, 8, 16, 4))
    torch.testing.assert_close(got, linear_fp32(wide, w, b), rtol=1e-5, atol=1e-4)
    # Into a given output (the graphs' shared logits buffer), kernel and torch paths alike.
    for cfg in ((16, 8, 16, 4), None):
        out = torch.full((m, n), float("nan"))
        got = kernels.skinny.skinny_linear(x, w, b, config=cfg, out=out)
        assert got is out or m > kernels.skinny.MAX_M
        torch.testing.assert_close(out, linear_fp32(x, w, b), rtol=1e-5, atol=1e-4)
    # The layers' ``linear`` is the measured dispatcher; off CUDA it is plain F.linear.
    torch.testing.assert_close(kernels.ops.linear(x, w, b), torch.nn.functional.linear(x, w, b))
    out = torch.empty(m, n)
    kernels.ops.linear(x, w, b, out=out)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, w, b))


@pytest.mark.parametrize("m,n,k,residual,bias", [(1, 24, 40, True, False), (3, 37, 64, True, True),
                                                 (2, 16, 48, False, False),
                                                 (2, 24, 100, True, False)])
def test_skinny_norm_linear(kernels, m, n, k, residual, bias):
    """Residual add + RMSNorm folded into the projection: same output and new residual as
    the separate ops (rounding included), and the residual is the input when there is none."""
    g = torch.Generator().manual_seed(m * 10 + k)
    x = torch.randn(m, k, generator=g)
    res = torch.randn(m, k, generator=g) if residual else None
    nw, w = torch.randn(k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    skinny = kernels.skinny
    # One K chunk; several (an unrolled loop); more than MAX_UNROLL (a loop), for k=100.
    for cfg in (None, (4, 8, 16, 4)):
        y, new_res = skinny.skinny_norm_linear(x, res, nw, 1e-6, w, b, config=cfg)
        ref_y, ref_res = norm_linear_fp32(x, res, nw, 1e-6, w, b)
        torch.testing.assert_close(new_res, ref_res, rtol=0, atol=0)
        torch.testing.assert_close(y, ref_y, rtol=1e-5, atol=1e-4)
        if res is None:
            assert new_res is x
    # The layers' op: off CUDA it is the separate add_rms_norm + F.linear.
    y, new_res = kernels.ops.norm_linear(x, res, nw, 1e-6, w, b)
    torch.testing.assert_close(y, ref_y, rtol=1e-5, atol=1e-4)


def test_skinny_silu_linear(kernels):
    g = torch.Generator().manual_seed(8)
    gate_up, w = torch.randn(3, 2 * 40, generator=g), torch.randn(24, 40, generator=g)
    want = linear_fp32(ref.silu_and_mul(gate_up), w)
    for cfg in (None, (4, 8, 16, 4), (4, 8, 8, 4)):  # 1, 3 (unrolled) and 5 (loop) chunks
        torch.testing.assert_close(kernels.skinny.skinny_silu_linear(gate_up, w, config=cfg),
                                   want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(kernels.ops.silu_linear(gate_up, w), want, rtol=1e-5, atol=1e-4)


def test_tuning_digest_follows_kernels_not_host_code(kernels, monkeypatch):
    """The disk cache of projection timings is keyed by a digest of the kernel sources and
    tile candidates: a new candidate changes it, the host code around it does not count."""
    tuner = kernels.tuner
    skinny = kernels.skinny
    tuner.kernels_revision.cache_clear()
    first = tuner.kernels_revision()
    tuner.kernels_revision.cache_clear()
    assert tuner.kernels_revision() == first and len(first) == 12
    monkeypatch.setitem(skinny.CANDIDATES, 1, skinny.CANDIDATES[1] + [(32, 128, 4)])
    tuner.kernels_revision.cache_clear()
    second = tuner.kernels_revision()
    assert second != first
    monkeypatch.setattr(tuner, "TIE", tuner.TIE + 0.01)  # the tie rule decides too
    tuner.kernels_revision.cache_clear()
    assert tuner.kernels_revision() not in (first, second)
    tuner.kernels_revision.cache_clear()


def test_tuner_prefers_fewer_warps_on_near_ties(kernels, monkeypatch):
    """``_tune`` keeps the fastest tile unless a tile with fewer warps is within ``TIE`` of
    it, and the unfused path only when it is faster than that tile by more than ``TIE``."""
    tuner = kernels.tuner
    monkeypatch.setattr(kernels.skinny, "candidate_configs", lambda m, k, weight_dtype=None: [
        (1, 8, 1024, 8), (1, 4, 1024, 4), (1, 4, 512, 4), (1, 2, 1024, 2)])

    def run(times, baseline):
        def timer(fn, weights):
            return fn(weights[0])
        monkeypatch.setattr(tuner, "graph_time_us", timer)
        return tuner._tune(("plain", 1, 64, 1024), [None], lambda w: baseline,
                          lambda cfg, w: times[cfg])

    t = {(1, 8, 1024, 8): 2.17, (1, 4, 1024, 4): 2.20, (1, 4, 512, 4): 2.19, (1, 2, 1024, 2): 2.5}
    assert run(t, 9.0) == ((1, 4, 512, 4), 2.19, 9.0)  # 4 warps within 2%: the faster of them
    t[(1, 2, 1024, 2)] = 2.21
    assert run(t, 9.0)[0] == (1, 2, 1024, 2)
    t = {(1, 8, 1024, 8): 2.0, (1, 4, 1024, 4): 2.2, (1, 4, 512, 4): 2.3, (1, 2, 1024, 2): 2.5}
    assert run(t, 9.0)[0] == (1, 8, 1024, 8)  # no near tie: the fastest
    assert run(t, 1.9) == (None, 1.9, 1.9)  # the unfused path is faster by more than TIE
    assert run(t, 1.97)[0] == (1, 8, 1024, 8)  # a near tie: one launch beats two


def test_each_launch_records_the_bytes_it_moves(kernels, monkeypatch):
    """A skinny launch notes its bytes (weights, scales, input and output rows) under its
    kernel name and grid, for the profiler's bandwidth per launch shape."""
    from replaylm.kernels import launch_bytes

    monkeypatch.setattr(launch_bytes, "BYTES", {})
    x, w = torch.randn(2, 64), torch.randn(24, 64)
    kernels.skinny.skinny_linear(x, w, config=(2, 8, 32, 4))
    assert launch_bytes.lookup("_skinny_kernel", [3, 1, 1]) == (2 * 64 + 24 * 64 + 2 * 24) * 4
    assert launch_bytes.lookup("_skinny_kernel", [6, 1, 1]) is None


@pytest.mark.parametrize("prologue", ["plain", "norm"])
@pytest.mark.parametrize("rows,inter,tile", [(1, 24, (2, 32, 4)), (3, 20, (8, 32, 4)),
                                             (2, 36, (16, 64, 4))])
def test_silu_pairs_epilogue_is_silu_and_mul_of_the_projection(kernels, prologue, rows, inter,
                                                               tile):
    """``silu_pairs``: each program takes gate rows and the up rows paired with them and
    stores ``silu(g) * u`` ([M, I]), bit for bit what ``silu_and_mul`` makes of the stored
    projection (I not a multiple of the half strip: the last strip is partly masked)."""
    skinny = kernels.skinny
    g = torch.Generator().manual_seed(rows * 10 + inter)
    k = 64
    x, w = torch.randn(rows, k, generator=g), torch.randn(2 * inter, k, generator=g) * 0.3
    b = torch.randn(2 * inter, generator=g)
    config = (max(1, 1 << (rows - 1).bit_length()), *tile)
    if prologue == "norm":
        res, nw = torch.randn(rows, k, generator=g), torch.rand(k, generator=g) + 0.5
        y, want_res = skinny.skinny_norm_linear(x, res, nw, 1e-5, w, b, config=config)
        got, got_res = skinny.skinny_norm_linear(x, res, nw, 1e-5, w, b, config=config,
                                                 silu_pairs=True)
        assert torch.equal(got_res, want_res)
    else:
        y = skinny.skinny_linear(x, w, b, config=config)
        got = skinny.skinny_linear(x, w, b, config=config, silu_pairs=True)
    want = kernels.elementwise.silu_and_mul(y)
    assert got.shape == (rows, inter)
    assert torch.equal(got, want)


@pytest.mark.parametrize("decision", ["whole", "split", "unfused"])
def test_ops_silu_out_pairs_in_whole_k_tiles_and_runs_silu_and_mul_otherwise(
        kernels, monkeypatch, decision):
    """``ops.norm_linear(silu_out=True)``: the paired epilogue on a whole-K tile, else
    ``silu_and_mul`` after the projection; the same result either way."""
    ops = kernels.ops
    g = torch.Generator().manual_seed(4)
    x, res = torch.randn(2, 64, generator=g), torch.randn(2, 64, generator=g)
    nw, w = torch.rand(64, generator=g) + 0.5, torch.randn(40, 64, generator=g) * 0.3
    config = {"whole": (2, 8, 32, 4), "split": (2, 8, 32, 4, 2), "unfused": None}[decision]
    monkeypatch.setattr(ops, "_few_rows", lambda t: 0 < t.shape[0] <= kernels.skinny.MAX_M)
    monkeypatch.setattr(kernels.tuner, "choose", lambda key, weight, unfused, fused: config)
    paired = []
    real = kernels.skinny._launch
    monkeypatch.setattr(kernels.skinny, "_launch",
                        lambda *a, **kw: paired.append(kw.get("silu_pairs")) or real(*a, **kw))
    got, new_res = ops.norm_linear(x, res, nw, 1e-5, w, silu_out=True)
    y, want_res = ref.norm_linear(x, res, nw, 1e-5, w)
    torch.testing.assert_close(got, ref.silu_and_mul(y), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(new_res, want_res, rtol=0, atol=0)
    assert (True in paired) == (decision == "whole")
