"""FP8 weights in the kernels, through the Triton interpreter (fp32 activations, e4m3
weights): the skinny kernel's FP8 variant (plain, norm and SiLU prologues) and the MoE
kernels with expert scales against the torch reference (dequantize, then the fp32 op); the
reference's quantization rule itself."""

from __future__ import annotations

import pytest
import torch

from replaylm.kernels import ref
from tests.kernels.moe_cases import fp8_moe_case


def _fp8(n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)  # rows of mixed ranges
    return ref.quantize_fp8(w)


def test_quantize_fp8_rule():
    """amax / 448 per output row, a zero row scaled 1, the dequantized weight within e4m3's
    relative step (2^-3) of the original, stacked experts per row too."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 32, generator=g)
    w[2] = 0
    q, scale = ref.quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert scale.shape == (6,)
    torch.testing.assert_close(scale[[0, 1, 3]], w[[0, 1, 3]].abs().amax(1) / 448)
    assert scale[2] == 1 and torch.all(q[2].float() == 0)
    back = ref.dequantize(q, scale, torch.float32)
    assert torch.all((back - w).abs() <= w.abs() * 2**-4 + scale[:, None] * 2**-9)
    assert back.abs().amax(1)[0] == pytest.approx(w[0].abs().max().item(), rel=1e-6)
    experts = torch.randn(3, 8, 16, generator=g)
    qe, se = ref.quantize_fp8(experts)
    assert se.shape == (3, 8)
    assert torch.equal(qe[1], ref.quantize_fp8(experts[1])[0])


@pytest.mark.parametrize("m,k", [(1, 64), (3, 100), (5, 5000)])
def test_quantize_rows_kernel(kernels, m, k):
    """W8A8's per-token quantization: one launch, the same e4m3 values and scales as the
    torch reference (a negative value rounding to zero is +0 there), across magnitudes
    (subnormals, the 448 clamp, ties), a zero row, and rows wider than one block (5,000 >
    4,096)."""
    g = torch.Generator().manual_seed(k)
    x = torch.randn(m, k, generator=g) * torch.logspace(-6, 3, m)[:, None]
    x[0, :4] = torch.tensor([0.0, -3e-9, 2.0**-10 * 3, 448.0 * 0.98])
    if m > 2:
        x[2] = 0
    q, scale = kernels.fp8_linear.quantize_rows(x)
    want_q, want_scale = ref.quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (m, 1)
    assert torch.equal(scale, want_scale)
    assert torch.equal(q.float(), want_q.float())
    if m > 2:
        assert scale[2] == ref.MIN_ROW_SCALE and torch.all(q[2].float() == 0)


@pytest.mark.parametrize("m,n,k,bias", [(1, 24, 64, False), (3, 37, 64, True),
                                        (8, 16, 100, False)])
def test_skinny_fp8_linear(kernels, m, n, k, bias):
    g = torch.Generator().manual_seed(m * 7 + n)
    x = torch.randn(m, k, generator=g)
    w, scale = _fp8(n, k, g)
    b = torch.randn(n, generator=g) if bias else None
    want = ref.linear(x, w, b, scale=scale)
    for cfg in (None, (16, 8, 32, 4), (16, 4, 16, 4)):  # 1-2 chunks, 4+ chunks (loop at k=100)
        got = kernels.skinny.skinny_linear(x, w, b, config=cfg, scale=scale)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    # Off CUDA the layers' op is the reference.
    torch.testing.assert_close(kernels.ops.linear(x, w, b, scale=scale), want)


@pytest.mark.parametrize("residual", [True, False])
def test_skinny_fp8_norm_linear(kernels, residual):
    g = torch.Generator().manual_seed(3)
    m, n, k = 2, 24, 48
    x = torch.randn(m, k, generator=g)
    res = torch.randn(m, k, generator=g) if residual else None
    nw = torch.randn(k, generator=g)
    w, scale = _fp8(n, k, g)
    want_y, want_res = ref.norm_linear(x, res, nw, 1e-6, w, scale=scale)
    for cfg in (None, (4, 8, 16, 4)):
        y, new_res = kernels.skinny.skinny_norm_linear(x, res, nw, 1e-6, w, config=cfg,
                                                       scale=scale)
        torch.testing.assert_close(new_res, want_res, rtol=0, atol=0)
        torch.testing.assert_close(y, want_y, rtol=1e-5, atol=1e-4)


def test_skinny_fp8_silu_linear(kernels):
    g = torch.Generator().manual_seed(4)
    gate_up = torch.randn(3, 2 * 40, generator=g)
    w, scale = _fp8(24, 40, g)
    want = ref.silu_linear(gate_up, w, scale=scale)
    for cfg in (None, (4, 8, 16, 4)):
        got = kernels.skinny.skinny_silu_linear(gate_up, w, config=cfg, scale=scale)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_fp8_candidates_stream_16_bytes(kernels):
    """The FP8 tiles are the bf16 ones with chunks twice as long in K (same bytes per
    load); the tuner times them for FP8 weights only."""
    skinny = kernels.skinny
    for bm, cands in skinny.CANDIDATES.items():
        assert skinny.CANDIDATES_FP8[bm] == [(bn, 2 * bk, w) for bn, bk, w in cands]
    fp8 = skinny.candidate_configs(1, 4096, torch.float8_e4m3fn)
    assert [c[2] for c in fp8] == [2 * c[2] for c in skinny.candidate_configs(1, 4096)]


@pytest.mark.parametrize("path", ["gemv", "grouped"])
def test_moe_fp8_experts(kernels, path):
    """The routed experts with FP8 weights: the per-assignment GEMVs and the grouped
    kernels apply each expert's row scales as the reference does."""
    args, want = fp8_moe_case(3, seed=5)
    if path == "gemv":
        got = kernels.moe_decode.gemv_moe(*args, gate_up_config=(16, 32, 4),
                                          down_config=(32, 16, 4))
    else:
        tile = kernels.moe.Tile(16, 16)
        got = kernels.moe.fused_moe(*args, config=kernels.moe.GroupedConfig(16, tile, tile))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
