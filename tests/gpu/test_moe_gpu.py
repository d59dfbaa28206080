"""MoE on the GPU: the shared expert on a side stream inside the captured graph; routing, the
per-assignment GEMVs, the one-launch grouping and the grouped kernels (every shipped config)
against the torch references."""

from __future__ import annotations

import pytest
import torch

from replaylm import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.fixture(scope="module")
def qwen2_moe_dir(tmp_path_factory):
    from tests.conftest import make_checkpoint

    path = tmp_path_factory.mktemp("gpu-qwen2-moe")
    make_checkpoint("qwen2_moe", path, seed=7)
    return path


def _run(path, mode: str, side_tokens: int, **kw):
    llm = LLM(str(path), cuda_graph_mode=mode, dtype="bfloat16", num_kv_blocks=32,
              max_num_seqs=8, max_num_batched_tokens=64, max_model_len=192,
              max_graph_tokens=64, skip_tokenizer_init=True,
              moe_side_stream_max_tokens=side_tokens, **kw)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 30, 1, 17, 44)]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    return llm, [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize("mode", ["full", "piecewise", "full_and_piecewise", "ragged"])
def test_side_stream_is_bit_identical_to_inline(qwen2_moe_dir, mode):
    """The same kernels on two streams: tokens and logprobs equal inline, bit for bit; the
    graphs fork onto one side stream (not one per layer) and hold the same nodes."""
    on, got_on = _run(qwen2_moe_dir, mode, side_tokens=64, graph_check=1)
    off, got_off = _run(qwen2_moe_dir, mode, side_tokens=0)
    assert got_on == got_off
    s_on, s_off = on.graph_stats(), off.graph_stats()
    sparse = sum(on.model_config.is_moe_layer(i) for i in range(on.model_config.num_layers))
    assert set(s_on["streams"].values()) == {2} and set(s_off["streams"].values()) == {1}
    for key, forks in s_on["forks"].items():
        # piecewise graphs: one link per layer, each capture forks its own layer once
        assert forks == sparse, (key, forks)
    assert s_on["checks"] > 0
    if s_on["nodes"] and s_off["nodes"]:
        assert s_on["nodes"] == s_off["nodes"]  # a fork and a join are edges, not nodes


def test_side_stream_limit_keeps_large_tiers_inline(qwen2_moe_dir):
    llm, _ = _run(qwen2_moe_dir, "ragged", side_tokens=8, graph_tiers="4,8,16,64")
    streams = llm.graph_stats()["streams"]
    assert streams == {"ragged:4": 2, "ragged:8": 2, "ragged:16": 1, "ragged:64": 1}


@pytest.mark.parametrize("t", [1, 16, 64, 256])
def test_grouped_moe_in_a_graph_serves_any_routing(t):
    """The grouped kernels at the qwen1.5-moe-a2.7b expert shape in bf16: close to the torch
    reference, and one capture replays any routing with the bits of an eager run."""
    from replaylm.kernels import moe, ref

    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(t)
    e, k, h, i = 60, 4, 2048, 1408
    w_gate_up = (torch.randn(e, 2 * i, h, generator=g, device=dev) * 0.02).to(dt)
    w_down = (torch.randn(e, h, i, generator=g, device=dev) * 0.02).to(dt)
    x = torch.randn(t, h, generator=g, device=dev).to(dt)
    logits = torch.randn(t, e, generator=g, device=dev).to(dt)
    weights, ids = ref.route_topk(logits, k, normalize=False)
    expected = ref.fused_moe(x, w_gate_up, w_down, weights, ids)
    got = moe.fused_moe(x, w_gate_up, w_down, weights, ids)
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)

    graph = torch.cuda.CUDAGraph()
    moe.fused_moe(x, w_gate_up, w_down, weights, ids)  # warm-up (compile) before capture
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        out = moe.fused_moe(x, w_gate_up, w_down, weights, ids)
    for seed in range(3):
        new = torch.randn(t, e, generator=g, device=dev).to(dt)
        if seed == 1:
            new[:, 5] += 50  # every token on expert 5
        w2, i2 = ref.route_topk(new, k, normalize=False)
        weights.copy_(w2)
        ids.copy_(i2)
        graph.replay()
        assert torch.equal(out, moe.fused_moe(x, w_gate_up, w_down, weights, ids))


SHAPES = {  # experts, top_k, hidden, expert FFN, renormalise
    "qwen1.5-moe-a2.7b": (60, 4, 2048, 1408, False),
    "qwen3-30b-a3b": (128, 8, 2048, 768, True),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("t", [1, 5, 64, 300])
def test_fused_routing_matches_reference(shape, t):
    """One launch of softmax, top-k and renormalisation: the reference's weights, and ids
    that are a top-k of the probabilities (bf16 logits may tie; the kernel takes the lower
    id, the reference's order on ties is unspecified)."""
    from replaylm.kernels import moe_route, ref

    e, k, _, _, normalize = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(t)
    logits = (torch.randn(t, e, generator=g, device="cuda") * 2).to(torch.bfloat16)
    weights, ids = moe_route.route_topk(logits, k, normalize)
    ref_w, _ = ref.route_topk(logits, k, normalize)
    torch.testing.assert_close(weights.float(), ref_w.float(), rtol=1e-2, atol=1e-3)
    probs = torch.softmax(logits.float(), dim=-1)
    top = torch.topk(probs, k, dim=-1).values
    torch.testing.assert_close(probs.gather(1, ids), top, rtol=1e-5, atol=1e-7)
    assert (ids.sort(dim=1).values.diff(dim=1) > 0).all()  # k distinct experts per token


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("t", [1, 4, 16])
def test_gemv_moe_in_a_graph_serves_any_routing(shape, t):
    """The per-assignment GEMVs at the real expert shapes in bf16: close to the torch
    reference, and one capture replays any routing with the bits of an eager run."""
    from replaylm.kernels import moe_decode, moe_route, ref

    dev, dt = torch.device("cuda"), torch.bfloat16
    e, k, h, i, normalize = SHAPES[shape]
    g = torch.Generator(device=dev).manual_seed(t)
    w_gate_up = (torch.randn(e, 2 * i, h, generator=g, device=dev) * 0.02).to(dt)
    w_down = (torch.randn(e, h, i, generator=g, device=dev) * 0.02).to(dt)
    x = torch.randn(t, h, generator=g, device=dev).to(dt)
    logits = torch.randn(t, e, generator=g, device=dev).to(dt)
    weights, ids = moe_route.route_topk(logits, k, normalize)
    expected = ref.fused_moe(x, w_gate_up, w_down, weights, ids)
    got = moe_decode.gemv_moe(x, w_gate_up, w_down, weights, ids)
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)

    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        w_out, i_out = moe_route.route_topk(logits, k, normalize)
        out = moe_decode.gemv_moe(x, w_gate_up, w_down, w_out, i_out)
    for seed in range(3):
        logits.copy_(torch.randn(t, e, generator=g, device=dev).to(dt))
        if seed == 1:
            logits[:, 5] += 50  # every token on expert 5
        graph.replay()
        eager_w, eager_i = moe_route.route_topk(logits, k, normalize)
        assert torch.equal(i_out, eager_i) and torch.equal(w_out, eager_w)
        assert torch.equal(out, moe_decode.gemv_moe(x, w_gate_up, w_down, eager_w, eager_i))
        if seed == 1:
            assert (i_out[:, 0] == 5).all()


def test_shared_combine_matches_reference():
    from replaylm.kernels import moe_route, ref

    g = torch.Generator(device="cuda").manual_seed(0)
    routed, shared, x = (torch.randn(7, 2048, generator=g, device="cuda").to(torch.bfloat16)
                         for _ in range(3))
    gate_weight = (torch.randn(1, 2048, generator=g, device="cuda") * 0.05).to(torch.bfloat16)
    got = moe_route.shared_combine(routed, shared, x, gate_weight)
    expected = ref.shared_combine(routed, shared, x, gate_weight)
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("extra", [0, 1])
def test_engine_path_at_the_switch_matches_reference(extra):
    """``ops.fused_moe`` on either side of ``MAX_ASSIGNMENTS`` (GEMVs, then grouped)."""
    from replaylm.kernels import moe_decode, ops, ref

    dev, dt = torch.device("cuda"), torch.bfloat16
    e, k, h, i, normalize = SHAPES["qwen1.5-moe-a2.7b"]
    t = moe_decode.MAX_ASSIGNMENTS // k + extra
    g = torch.Generator(device=dev).manual_seed(extra)
    w_gate_up = (torch.randn(e, 2 * i, h, generator=g, device=dev) * 0.02).to(dt)
    w_down = (torch.randn(e, h, i, generator=g, device=dev) * 0.02).to(dt)
    x = torch.randn(t, h, generator=g, device=dev).to(dt)
    weights, ids = ops.route_topk(torch.randn(t, e, generator=g, device=dev).to(dt), k,
                                  normalize)
    got = ops.fused_moe(x, w_gate_up, w_down, weights, ids)
    expected = ref.fused_moe(x, w_gate_up, w_down, weights, ids)
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_every_shipped_grouped_config_matches_reference(fp8):
    """Each ``moe.CONFIGS`` entry at the qwen1.5-moe-a2.7b expert shape (bf16 and FP8
    experts), at a load above one tile per expert: close to the torch reference. (The table
    is read inside the test: importing a kernel module while collecting would import Triton
    before ``tests/kernels`` can choose its interpreter.)"""
    from replaylm.kernels import moe, ref

    dev, dt = torch.device("cuda"), torch.bfloat16
    e, k, h, i, normalize = SHAPES["qwen1.5-moe-a2.7b"]
    t = 300
    for _, config in moe.CONFIGS:
        g = torch.Generator(device=dev).manual_seed(config.block_m)
        w_gate_up = torch.randn(e, 2 * i, h, generator=g, device=dev, dtype=dt) * 0.02
        w_down = torch.randn(e, h, i, generator=g, device=dev, dtype=dt) * 0.02
        scales = (None, None)
        if fp8:
            (w_gate_up, gu_scale), (w_down, d_scale) = map(ref.quantize_fp8, (w_gate_up, w_down))
            scales = (gu_scale, d_scale)
        x = torch.randn(t, h, generator=g, device=dev).to(dt)
        logits = torch.randn(t, e, generator=g, device=dev).to(dt)
        logits[: t // 2, 7] += 50  # half the tokens on expert 7: several tiles at any BLOCK_M
        weights, ids = ref.route_topk(logits, k, normalize)
        expected = ref.fused_moe(x.float(), w_gate_up if fp8 else w_gate_up.float(),
                                 w_down if fp8 else w_down.float(), weights.float(), ids, *scales)
        got = moe.fused_moe(x, w_gate_up, w_down, weights, ids, *scales, config=config)
        torch.testing.assert_close(got.float(), expected, rtol=3e-2, atol=3e-2,
                                   msg=lambda m, c=config: f"{c}: {m}")


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("t", [1, 16, 64, 256, 1100])
def test_align_kernel_equals_torch_grouping(shape, t):
    """The one-launch grouping (compiled: its histogram and scans) against the torch ops,
    bit for bit, at each ``BLOCK_M``; 1100 tokens of qwen3-30b-a3b span several chunks."""
    from replaylm.kernels import moe, moe_align, moe_route

    e, k, _, _, normalize = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(t)
    logits = torch.randn(t, e, generator=g, device="cuda").to(torch.bfloat16)
    logits[:, 3] += 2  # a popular expert
    _, ids = moe_route.route_topk(logits, k, normalize)
    for block_m in moe.BLOCK_MS:
        got = moe_align.align_kernel(ids, e, block_m)
        want = moe_align.align_reference(ids, e, block_m)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), block_m
