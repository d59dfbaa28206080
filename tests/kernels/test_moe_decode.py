"""The decode-size MoE kernels (``kernels.moe_decode``, ``kernels.moe_route``) vs the torch
references, through the Triton interpreter (fp32): fused routing (ties, renormalisation, NaN rows), the
per-assignment expert GEMVs (random routing, experts without tokens, every token on one
expert, batch 1, the path switch's threshold, tiles that do not divide the shapes), and the
shared expert's gated add."""

from __future__ import annotations

import pytest
import torch

from replaylm.graphs.stand_in import no_host_sync
from replaylm.kernels import ref
from tests.kernels.moe_cases import moe_case


def _stable_topk(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k ids with ties to the lower id: the kernel's documented order."""
    probs = torch.softmax(logits.float(), dim=-1)
    return torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :k]


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("t,e,k", [(1, 60, 4), (9, 8, 2), (5, 128, 8), (3, 5, 5)])
def test_route_topk_matches_reference(kernels, t, e, k, normalize):
    g = torch.Generator().manual_seed(t * e + k)
    logits = torch.randn(t, e, generator=g) * 3
    with no_host_sync("moe route"):
        weights, ids = kernels.moe_route.route_topk(logits, k, normalize)
    ref_w, ref_ids = ref.route_topk(logits, k, normalize)
    assert ids.dtype == torch.int64 and weights.dtype == logits.dtype
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, rtol=1e-6, atol=1e-7)


def test_route_topk_ties_go_to_the_lower_expert(kernels):
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, -1.0],
                           [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],   # all tied (a zero row)
                           [2.0, 2.0, 5.0, 2.0, 2.0, 2.0]])
    weights, ids = kernels.moe_route.route_topk(logits, 3, normalize=True)
    assert ids.tolist() == [[1, 2, 4], [0, 1, 2], [2, 0, 1]]
    assert torch.equal(ids, _stable_topk(logits, 3))
    ref_w, _ = ref.route_topk(logits, 3, normalize=True)  # equal values whatever ids tie
    torch.testing.assert_close(weights, ref_w, rtol=1e-6, atol=1e-7)


def test_route_topk_keeps_nan_rows_on_real_experts(kernels):
    """A padded row may carry NaN (``poison_padding``): its ids must still name experts, so
    the expert kernels read inside the weights; other rows are unaffected."""
    logits = torch.randn(3, 12, generator=torch.Generator().manual_seed(0))
    logits[1] = float("nan")
    weights, ids = kernels.moe_route.route_topk(logits, 4, normalize=False)
    assert ((ids >= 0) & (ids < 12)).all()
    ref_w, ref_ids = ref.route_topk(logits[[0, 2]], 4, normalize=False)
    assert torch.equal(ids[[0, 2]], ref_ids)
    torch.testing.assert_close(weights[[0, 2]], ref_w)


def test_route_topk_refuses_more_choices_than_experts(kernels):
    with pytest.raises(ValueError, match="top_k=5"):
        kernels.moe_route.route_topk(torch.zeros(1, 4), 5, normalize=False)




GEMV_CASES = {
    # t, e, k, h, i, per-expert logit bias, (gate_up config, down config) or None (picked)
    "batch_1": (1, 12, 4, 64, 48, None, None),
    "random": (7, 8, 2, 48, 40, None, ((8, 32, 4), (16, 16, 4))),
    "unused_experts": (5, 10, 3, 32, 24, torch.tensor([-50.0] * 4 + [0.0] * 6),
                       ((8, 32, 4), (16, 32, 4))),
    "one_expert": (6, 6, 1, 32, 32, torch.tensor([0.0, 0.0, 80.0, 0.0, 0.0, 0.0]),
                   ((32, 32, 4), (32, 32, 4))),
    "ragged_tiles": (3, 9, 2, 40, 24, None, ((16, 32, 4), (32, 16, 4))),  # masked tails
    "many_chunks": (2, 8, 3, 32, 40, None, ((8, 16, 4), (8, 8, 4))),  # down strip streamed
}


@pytest.mark.parametrize("case", sorted(GEMV_CASES))
def test_gemv_moe_matches_reference(kernels, case):
    t, e, k, h, i, bias, configs = GEMV_CASES[case]
    x, w_gate_up, w_down, weights, ids = moe_case(t, e, k, h, i, seed=len(case), bias=bias, normalize=True)
    if case == "unused_experts":
        assert (ids >= 4).all()
    if case == "one_expert":
        assert (ids == 2).all()
    gate_up_cfg, down_cfg = configs or (None, None)
    with no_host_sync("moe gemv"):
        got = kernels.moe_decode.gemv_moe(x, w_gate_up, w_down, weights, ids,
                                          gate_up_config=gate_up_cfg, down_config=down_cfg)
    torch.testing.assert_close(got, ref.fused_moe(x, w_gate_up, w_down, weights, ids),
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("extra", [0, 1])
def test_ops_switch_paths_at_the_threshold(kernels, monkeypatch, extra):
    """``ops.fused_moe`` on CUDA tensors takes the GEMVs up to ``MAX_ASSIGNMENTS`` pairs and
    the grouped kernels above; both agree with the reference at the threshold."""
    md = kernels.moe_decode
    monkeypatch.setattr(md, "MAX_ASSIGNMENTS", 8)
    t, k = 4 + extra, 2
    x, w_gate_up, w_down, weights, ids = moe_case(t, 6, k, 32, 16, seed=11 + extra, normalize=True)
    calls = []
    monkeypatch.setattr(md, "gemv_moe", lambda *a: calls.append("gemv") or a[0])
    monkeypatch.setattr(kernels.moe, "fused_moe", lambda *a: calls.append("grouped") or a[0])
    cuda_x = type("CudaRows", (), {"is_cuda": True})()
    kernels.ops.fused_moe(cuda_x, w_gate_up, w_down, weights, ids)
    assert calls == ["gemv" if t * k <= 8 else "grouped"]
    monkeypatch.undo()
    expected = ref.fused_moe(x, w_gate_up, w_down, weights, ids)
    for got in (kernels.moe_decode.gemv_moe(x, w_gate_up, w_down, weights, ids,
                                            gate_up_config=(16, 32, 4),
                                            down_config=(32, 16, 4)),
                kernels.moe.fused_moe(x, w_gate_up, w_down, weights, ids,
                                      config=kernels.moe.GroupedConfig(
                                          16, kernels.moe.Tile(16, 16), kernels.moe.Tile(16, 16)))):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_shared_combine_matches_reference(kernels):
    g = torch.Generator().manual_seed(4)
    t, h = 5, 40  # H not a power of two: masked lanes
    routed, shared, x = (torch.randn(t, h, generator=g) for _ in range(3))
    gate_weight = torch.randn(1, h, generator=g) * 0.2
    with no_host_sync("moe combine"):
        got = kernels.moe_route.shared_combine(routed, shared, x, gate_weight)
    torch.testing.assert_close(got, ref.shared_combine(routed, shared, x, gate_weight),
                               rtol=1e-5, atol=1e-6)


def test_pick_config_covers_the_gpu_and_the_reduction(kernels):
    pick = kernels.moe_decode.pick_config
    # batch 1 of Qwen1.5-MoE-A2.7B: gate_up over 4 assignments x 1408 columns, down 2048
    bn, bk, warps = pick(4, 1408, 2048, operands=2)
    assert 4 * -(-1408 // bn) >= 4 * 132 and bk == 512 and warps == 8
    bn, bk, _ = pick(1, 2048, 1408)
    assert bn == 2 and bk == 512
    assert pick(64, 1408, 2048)[:2] == (32, 256)  # many rows: wide strips
    assert pick(64, 1408, 2048, operands=2)[:2] == (16, 256)  # chunks of 256 at least
    assert pick(1, 16, 24)[1] == 32  # short reductions: one chunk
    for rows in (1, 4, 16, 64, 256, 1024):
        for operands in (1, 2, 4, 8):
            bn, bk, warps = pick(rows, 1408, 2048, operands=operands)
            assert operands * bn * bk <= kernels.moe_decode.MAX_TILE
            assert operands * bn * bk <= 4096 or warps == 8
