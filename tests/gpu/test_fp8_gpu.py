"""FP8 weights on the GPU: the skinny kernel's FP8 variant against its reference at every
shipped projection shape (Llama 3.2 1B and Llama 3 8B), its split-K tiles (prologues and a
graph replay included), the tuned dispatch, W8A8 and the
dequantize path above the skinny rows, the MoE kernels with FP8 experts, and the FP8 engine
in graph modes with padding poisoned and every replay checked bit for bit.

Run with ``pytest -m gpu tests/gpu/test_fp8_gpu.py``; skipped without CUDA/Triton.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

from tests.gpu.requires import compiled_triton  # noqa: E402

triton = compiled_triton()

from replaylm import LLM, SamplingParams  # noqa: E402
from replaylm.kernels import fp8_linear, moe, moe_decode, ops, ref, skinny, tuner  # noqa: E402

DEV = torch.device("cuda")
BF16 = torch.bfloat16
#: (n, k) of the projections in the shipped tuning tables: Llama 3.2 1B's qkv, o, gate_up,
#: down and LM head, then Llama 3 8B's.
SHAPES_1B = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (128256, 2048)]
SHAPES_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]


def _fp8_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=DEV).manual_seed(seed)
    w = torch.empty(n, k, device=DEV, dtype=BF16).uniform_(-0.0346, 0.0346, generator=g)
    return ref.quantize_fp8(w)


def _want(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, b=None) -> torch.Tensor:
    """The reference in fp32 (dequantized weight, fp32 product), rounded to bf16."""
    return ref.linear(x.float(), w, None if b is None else b.float(), scale=scale).to(x.dtype)


@pytest.mark.parametrize("m", [1, 2, 4, 8])
@pytest.mark.parametrize("n,k", SHAPES_1B + SHAPES_8B)
def test_skinny_fp8_linear_at_shipped_shapes(m, n, k):
    """The FP8 skinny kernel (untuned tile) against the reference, repeatable to the bit."""
    w, scale = _fp8_weight(n, k, n + k)
    x = torch.randn(m, k, device=DEV, dtype=BF16, generator=torch.Generator(device=DEV)
                    .manual_seed(m))
    want = _want(x, w, scale)
    got = skinny.skinny_linear(x, w, scale=scale)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    assert torch.equal(got, skinny.skinny_linear(x, w, scale=scale))


@pytest.mark.parametrize("m,n,k", [(1, 2048, 2048), (1, 4096, 4096), (4, 6144, 4096)])
def test_tuned_fp8_linear(m, n, k):
    """Every FP8 tile candidate against the reference; the tuned dispatch records an
    ``-fp8`` decision and matches too, bit-repeatably."""
    w, scale = _fp8_weight(n, k, n + k)
    x = torch.randn(m, k, device=DEV, dtype=BF16, generator=torch.Generator(device=DEV)
                    .manual_seed(m))
    want = _want(x, w, scale)
    for cfg in tuner.candidates(m, k, ref.FP8_DTYPE):
        got = skinny.skinny_linear(x, w, config=cfg, scale=scale)
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2, msg=f"tile {cfg}")
    chosen = ops.linear(x, w, scale=scale)
    assert ("plain-fp8", ops.row_block(m), n, k, BF16, False) in tuner.LINEAR_CHOICES
    torch.testing.assert_close(chosen, want, atol=2e-2, rtol=2e-2)
    assert torch.equal(chosen, ops.linear(x, w, scale=scale))


def _norm_case(m: int, n: int, k: int, g: torch.Generator):
    """Rows, residual, norm weight, FP8 weight and scale of a residual add + RMSNorm +
    projection, with the references' output and new residual."""
    x = torch.randn(m, k, device=DEV, dtype=BF16, generator=g)
    res = torch.randn(m, k, device=DEV, dtype=BF16, generator=g)
    nw = torch.rand(k, device=DEV, dtype=BF16, generator=g) + 0.5
    w, scale = _fp8_weight(n, k, n)
    normed, want_res = ref.add_rms_norm(x, res, nw, 1e-6)
    return x, res, nw, w, scale, _want(normed, w, scale), want_res


@pytest.mark.parametrize("m,n,k", [(1, 3072, 2048), (5, 6144, 4096)])
def test_skinny_fp8_norm_linear(m, n, k):
    g = torch.Generator(device=DEV).manual_seed(n + m)
    x, res, nw, w, scale, want, want_res = _norm_case(m, n, k, g)
    y, new_res = skinny.skinny_norm_linear(x, res, nw, 1e-6, w, scale=scale)
    assert torch.equal(new_res, want_res)
    torch.testing.assert_close(y, want, atol=3e-2, rtol=3e-2)
    y, new_res = ops.norm_linear(x, res, nw, 1e-6, w, scale=scale)
    torch.testing.assert_close(y, want, atol=3e-2, rtol=3e-2)
    assert ("norm-fp8", ops.row_block(m), n, k, BF16, False) in tuner.LINEAR_CHOICES


@pytest.mark.parametrize("m,n,k", [(1, 2048, 8192), (5, 4096, 14336)])
def test_skinny_fp8_silu_linear(m, n, k):
    g = torch.Generator(device=DEV).manual_seed(n + m)
    gate_up = torch.randn(m, 2 * k, device=DEV, dtype=BF16, generator=g)
    w, scale = _fp8_weight(n, k, k)
    want = _want(ref.silu_and_mul(gate_up), w, scale)
    got = skinny.skinny_silu_linear(gate_up, w, scale=scale)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(ops.silu_linear(gate_up, w, scale=scale), want, atol=2e-2,
                               rtol=2e-2)
    assert ("silu-fp8", ops.row_block(m), n, k, BF16, False) in tuner.LINEAR_CHOICES


def _split_tiles(m: int, k: int, dtype: torch.dtype | None) -> list[tuple[int, ...]]:
    return [c for c in tuner.candidates(m, k, dtype) if len(c) == 5]


@pytest.mark.parametrize("m,n,k", [(2, 6144, 4096), (4, 4096, 14336), (8, 28672, 4096)])
def test_split_k_tiles_fp8_at_8b_shapes(m, n, k):
    """Every split-K tile the tuner times (one per row block from two rows), forced at Llama
    3 8B's projections: the plain product against the reference, bit-repeatable (partials
    summed in a fixed order)."""
    w, scale = _fp8_weight(n, k, n + k)
    x = torch.randn(m, k, device=DEV, dtype=BF16, generator=torch.Generator(device=DEV)
                    .manual_seed(m))
    want = _want(x, w, scale)
    tiles = _split_tiles(m, k, ref.FP8_DTYPE)
    assert tiles, (m, k)
    for cfg in tiles:
        got = skinny.skinny_linear(x, w, config=cfg, scale=scale)
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2, msg=f"tile {cfg}")
        assert torch.equal(got, skinny.skinny_linear(x, w, config=cfg, scale=scale))


@pytest.mark.parametrize("m", [2])
def test_split_k_prologues_fp8(m):
    """Split-K with the RMSNorm prologue (qkv, gate_up shapes: the sum of squares split
    with K) and the SiLU·mul prologue (down), every split tile, against the references."""
    g = torch.Generator(device=DEV).manual_seed(m)
    assert all(_split_tiles(m, k, ref.FP8_DTYPE) for _, k in SHAPES_8B[:4])
    for n, k in (SHAPES_8B[0], SHAPES_8B[2]):
        x, res, nw, w, scale, want, want_res = _norm_case(m, n, k, g)
        for cfg in _split_tiles(m, k, ref.FP8_DTYPE):
            y, new_res = skinny.skinny_norm_linear(x, res, nw, 1e-6, w, config=cfg,
                                                   scale=scale)
            assert torch.equal(new_res, want_res), cfg
            torch.testing.assert_close(y, want, atol=3e-2, rtol=3e-2, msg=f"tile {cfg}")
    n, k = SHAPES_8B[3]
    gate_up = torch.randn(m, 2 * k, device=DEV, dtype=BF16, generator=g)
    w, scale = _fp8_weight(n, k, k)
    want = _want(ref.silu_and_mul(gate_up), w, scale)
    for cfg in _split_tiles(m, k, ref.FP8_DTYPE):
        got = skinny.skinny_silu_linear(gate_up, w, config=cfg, scale=scale)
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2, msg=f"tile {cfg}")


def test_split_k_graph_replay_matches_eager():
    """A split-K launch (partials from the capture's pool) replayed from a CUDA graph
    equals its eager run bit for bit, after the inputs change in place."""
    n, k = SHAPES_8B[1]
    w, scale = _fp8_weight(n, k, 11)
    g = torch.Generator(device=DEV).manual_seed(11)
    x = torch.randn(2, k, device=DEV, dtype=BF16, generator=g)
    res = torch.randn(2, k, device=DEV, dtype=BF16, generator=g)
    nw = torch.rand(k, device=DEV, dtype=BF16, generator=g) + 0.5
    assert _split_tiles(2, k, ref.FP8_DTYPE)
    for cfg in _split_tiles(2, k, ref.FP8_DTYPE):
        skinny.skinny_norm_linear(x, res, nw, 1e-6, w, config=cfg, scale=scale)  # compile
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y, new_res = skinny.skinny_norm_linear(x, res, nw, 1e-6, w, config=cfg,
                                                   scale=scale)
        x.copy_(torch.randn(2, k, device=DEV, dtype=BF16, generator=g))
        graph.replay()
        want_y, want_res = skinny.skinny_norm_linear(x, res, nw, 1e-6, w, config=cfg,
                                                     scale=scale)
        torch.cuda.synchronize()
        assert torch.equal(y, want_y) and torch.equal(new_res, want_res), cfg


def test_fp32_activations_stay_fp32():
    """An fp32 model with FP8 weights: the skinny kernel and the dequantize path agree with
    the fp32 reference to fp32 accuracy (no TF32, no bf16 rounding anywhere)."""
    w, scale = _fp8_weight(1024, 2048, 7)
    for m in (1, 4, 64):
        x = torch.randn(m, 2048, device=DEV)
        want = ref.dequantize(w, scale, torch.float64) @ x.double().T
        got = ops.linear(x, w, scale=scale)
        torch.testing.assert_close(got.double(), want.T, rtol=1e-5, atol=1e-5)
    assert not fp8_linear.w8a8_applies(x, w)


@pytest.mark.parametrize("m", [16, 64, 512])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336)])
def test_many_rows_w8a8(m, n, k):
    """Above the skinny rows: W8A8 (per-token activation scales) within the activation
    quantization's error of the dequantized product; ``ops.linear`` takes it."""
    w, scale = _fp8_weight(n, k, m)
    x = torch.randn(m, k, device=DEV, dtype=BF16)
    assert fp8_linear.w8a8_applies(x, w)
    want = ref.linear(x.float(), w, scale=scale)
    got = ops.linear(x, w, scale=scale).float()
    rel = (got - want).norm() / want.norm()
    assert rel < 0.05, rel
    out = torch.empty(m, n, device=DEV, dtype=BF16)
    assert ops.linear(x, w, scale=scale, out=out) is out
    assert torch.equal(out.float(), got)


@pytest.mark.parametrize("path", ["gemv", "grouped"])
def test_moe_fp8_experts(path):
    """Qwen1.5-MoE's expert shapes with FP8 experts: both expert paths against the
    reference."""
    e, k, h, i = 60, 4, 2048, 1408
    g = torch.Generator(device=DEV).manual_seed(3)
    t = 2 if path == "gemv" else 24
    x = torch.randn(t, h, device=DEV, dtype=BF16, generator=g)
    gate_up, gu_scale = ref.quantize_fp8(torch.randn(e, 2 * i, h, device=DEV, dtype=BF16,
                                                     generator=g) * 0.02)
    down, d_scale = ref.quantize_fp8(torch.randn(e, h, i, device=DEV, dtype=BF16,
                                                 generator=g) * 0.02)
    weights, ids = ref.route_topk(torch.randn(t, e, device=DEV, dtype=BF16, generator=g), k,
                                  False)
    want = ref.fused_moe(x.float(), gate_up, down, weights.float(), ids, gu_scale, d_scale)
    fn = moe_decode.gemv_moe if path == "gemv" else moe.fused_moe
    got = fn(x, gate_up, down, weights, ids, gu_scale, d_scale)
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("mode", ["full", "piecewise", "ragged"])
def test_fp8_engine_graphs_bit_identical_under_poisoned_padding(tmp_path, mode):
    """The FP8 engine (bf16 activations, fused kernels) in a graph mode: padding rows carry
    NaN and every replay is compared bit for bit with an eager run of the same batch
    (``graph_check``); greedy tokens equal the eager engine's."""
    from tests.conftest import make_checkpoint

    make_checkpoint("llama", tmp_path, hidden_size=256, intermediate_size=512)
    kw = dict(quantization="fp8", skip_tokenizer_init=True, max_model_len=128,
              max_num_seqs=8, dtype="bfloat16")
    prompts = [[3 + j, 17, 99, 4 + j, 250] for j in range(5)]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    eager = LLM(str(tmp_path), enforce_eager=True, **kw)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, sp, use_tqdm=False)]
    eager.shutdown()
    with LLM(str(tmp_path), cuda_graph_mode=mode, graph_check=1, poison_padding=True,
             **kw) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        stats = llm.graph_stats()
        assert stats["hits"] and stats["checks"] > 0, stats
    assert got == want


@pytest.mark.parametrize("fp8", [False, True])
def test_rows_of_one_row_block_agree_bit_for_bit(fp8):
    """Every row count of a row block takes the same tile (``ops.row_block``), so the
    first 5 rows of an 8-row projection equal a 5-row projection of them bit for bit (an
    eager step of 5 requests and a graph tier of 8 give each request the same sums)."""
    g = torch.Generator(device=DEV).manual_seed(11)
    w = torch.randn(1536, 2048, device=DEV, dtype=BF16, generator=g) * 0.02
    w, scale = ref.quantize_fp8(w) if fp8 else (w, None)
    x = torch.randn(8, 2048, device=DEV, dtype=BF16, generator=g)
    r = torch.randn(8, 2048, device=DEV, dtype=BF16, generator=g)
    nw = torch.rand(2048, device=DEV, dtype=BF16, generator=g) + 0.5
    assert torch.equal(ops.linear(x[:5], w, scale=scale), ops.linear(x, w, scale=scale)[:5])
    y5, res5 = ops.norm_linear(x[:5], r[:5], nw, 1e-5, w, scale=scale)
    y8, res8 = ops.norm_linear(x, r, nw, 1e-5, w, scale=scale)
    assert torch.equal(y5, y8[:5]) and torch.equal(res5, res8[:5])


@pytest.mark.parametrize("m,k", [(1, 4096), (7, 14336), (300, 2048)])
def test_quantize_rows_matches_reference(m, k):
    """W8A8's per-token quantization kernel: the torch reference's scales and e4m3 values (a
    negative value that rounds to zero is +0 from the kernel, -0 from torch: the same
    product)."""
    g = torch.Generator(device=DEV).manual_seed(m)
    x = torch.randn(m, k, device=DEV, dtype=BF16, generator=g) * 3
    q, scale = fp8_linear.quantize_rows(x)
    want_q, want_scale = ref.quantize_rows(x)
    assert torch.equal(scale, want_scale)
    assert torch.equal(q.float(), want_q.float())
