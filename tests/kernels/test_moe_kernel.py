"""The grouped fused-MoE kernels (``kernels.moe``, ``kernels.moe_align``) vs their torch
references, through the Triton interpreter: random routing, experts without tokens, every
token on one expert, batch 1, each ``BLOCK_M`` and FP8 experts; the one-launch grouping
against the torch grouping, bit for bit; the config rule."""

from __future__ import annotations

import math

import pytest
import torch

from replaylm.graphs.stand_in import no_host_sync
from replaylm.kernels import ref
from tests.kernels.moe_cases import fp8_moe_case, moe_case

CASES = {
    # t, e, k, h, i, per-expert logit bias
    "random": (37, 8, 2, 48, 40, None),
    "unused_experts": (21, 10, 3, 32, 24, torch.tensor([-50.0] * 4 + [0.0] * 6)),
    "one_expert": (40, 6, 1, 32, 32, torch.tensor([0.0, 0.0, 80.0, 0.0, 0.0, 0.0])),
    "batch_1": (1, 12, 4, 64, 48, None),
}
# (block_m, gate_up tile, down tile): (block_n, block_k, num_warps, num_stages)
CONFIGS = {
    16: ((32, 32, 4, 3), (32, 32, 4, 3)),
    32: ((16, 32, 4, 4), (32, 16, 8, 2)),
    64: ((32, 16, 2, 3), (16, 64, 4, 3)),
}


def _config(kernels, block_m: int):
    moe = kernels.moe
    gate_up, down = CONFIGS[block_m]
    return moe.GroupedConfig(block_m, moe.Tile(*gate_up), moe.Tile(*down))


@pytest.mark.parametrize("block_m", sorted(CONFIGS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_grouped_moe_matches_reference(kernels, case, block_m):
    t, e, k, h, i, bias = CASES[case]
    x, w_gate_up, w_down, weights, ids = moe_case(t, e, k, h, i, seed=len(case), bias=bias)
    if case == "unused_experts":
        assert (ids >= 4).all()
    if case == "one_expert":
        assert (ids == 2).all()
    with no_host_sync("grouped moe"):
        got = kernels.moe.fused_moe(x, w_gate_up, w_down, weights, ids,
                                    config=_config(kernels, block_m))
    torch.testing.assert_close(got, ref.fused_moe(x, w_gate_up, w_down, weights, ids),
                               rtol=1e-4, atol=1e-5)


def test_grouped_moe_picks_a_config(kernels):
    x, w_gate_up, w_down, weights, ids = moe_case(9, 6, 2, 40, 24, seed=2)
    got = kernels.moe.fused_moe(x, w_gate_up, w_down, weights, ids)
    torch.testing.assert_close(got, ref.fused_moe(x, w_gate_up, w_down, weights, ids),
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("block_m", sorted(CONFIGS))
def test_grouped_moe_fp8_experts(kernels, block_m):
    """FP8 experts: each expert's row scales applied as the reference does, at each
    ``BLOCK_M``."""
    args, want = fp8_moe_case(19, seed=block_m)
    got = kernels.moe.fused_moe(*args, config=_config(kernels, block_m))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


ALIGN_CASES = {
    # t, e, k, block_m, per-expert logit bias
    "random": (37, 8, 2, 16, None),
    "unused_experts": (50, 10, 3, 32, torch.tensor([-50.0] * 4 + [0.0] * 6)),
    "one_expert": (40, 6, 1, 64, torch.tensor([0.0, 0.0, 80.0, 0.0, 0.0, 0.0])),
    "batch_1": (1, 60, 4, 16, None),
    "many_chunks": (700, 6, 3, 32, None),  # 2,100 ids: three chunks of the kernel's loops
    "many_tiles": (500, 3, 3, 16, None),  # an expert's tiles span two chunks
}


@pytest.mark.parametrize("case", sorted(ALIGN_CASES))
def test_align_kernel_equals_torch_grouping(kernels, case):
    t, e, k, block_m, bias = ALIGN_CASES[case]
    g = torch.Generator().manual_seed(t)
    logits = torch.randn(t, e, generator=g) + (0 if bias is None else bias)
    _, ids = ref.route_topk(logits, k, normalize=False)
    ma = kernels.moe_align
    with no_host_sync("moe align"):
        slot_rows, tile_expert = ma.align_kernel(ids, e, block_m)
    want_rows, want_experts = ma.align_reference(ids, e, block_m)
    assert slot_rows.dtype == tile_expert.dtype == torch.int32
    assert torch.equal(slot_rows, want_rows) and torch.equal(tile_expert, want_experts)


@pytest.mark.parametrize("fn", ["align_kernel", "align_reference"])
def test_alignment_groups_by_expert_in_fixed_tiles_without_host_sync(kernels, fn):
    ma = kernels.moe_align
    ids = torch.tensor([[3, 1], [3, 0], [1, 3], [3, 2]])  # expert 3 four times, 4 unused
    with no_host_sync("moe align"):
        slot_rows, tile_expert = getattr(ma, fn)(ids, num_experts=5, block_m=2)
    tiles = ma.max_tiles(8, 5, 2)
    assert tiles == 9 and slot_rows.shape == (18,) and tile_expert.shape == (9,)
    # expert 0: one slot, expert 1: two, expert 2: one, expert 3: four (two tiles)
    assert tile_expert.tolist() == [0, 1, 2, 3, 3, -1, -1, -1, -1]
    flat = ids.flatten()
    used = slot_rows[: 5 * 2].view(5, 2)
    for tile, expert in enumerate(tile_expert[:5].tolist()):
        real = [int(r) for r in used[tile] if r < 8]
        assert real and all(int(flat[r]) == expert for r in real)
    assert sorted(int(r) for r in slot_rows if r < 8) == list(range(8))  # each exactly once


def test_align_takes_torch_ops_above_the_kernel_bound(kernels, monkeypatch):
    ma = kernels.moe_align
    calls = []
    monkeypatch.setattr(ma, "align_kernel", lambda *a: calls.append("kernel"))
    monkeypatch.setattr(ma, "align_reference", lambda *a: calls.append("torch"))
    ids = torch.zeros(5, 2, dtype=torch.int64)
    monkeypatch.setattr(ma, "MAX_KERNEL_ASSIGNMENTS", 10)
    ma.align(ids, 4, 16)
    monkeypatch.setattr(ma, "MAX_KERNEL_ASSIGNMENTS", 9)
    ma.align(ids, 4, 16)
    assert calls == ["kernel", "torch"]


def test_batch_1_tiles_read_only_the_chosen_experts(kernels):
    ids = torch.tensor([[7, 2, 9, 0]])
    slot_rows, tile_expert = kernels.moe.align(ids, num_experts=16, block_m=16)
    assert sorted(tile_expert.tolist()) == [0, 2, 7, 9]  # 4 tiles, one per chosen expert


def test_pick_config_takes_the_first_row_that_holds_the_load(kernels, monkeypatch):
    moe = kernels.moe
    # the shipped table, at the two named MoE shapes: its tiles fit them unchanged
    for t in (16, 64, 256, 4096):
        for e, k, h, i in ((60, 4, 2048, 1408), (128, 8, 2048, 768)):
            config = moe.pick_config(t * k, e, i, h)
            assert config in [c for _, c in moe.CONFIGS]
    tile = moe.Tile(128, 64, 8, 4)
    small, large = moe.GroupedConfig(16), moe.GroupedConfig(64, tile, tile)
    monkeypatch.setattr(moe, "CONFIGS", ((4.0, small), (math.inf, large)))
    assert moe.pick_config(240, 60, 1408, 2048) == small  # 4 assignments per expert
    assert moe.pick_config(241, 60, 1408, 2048) == large
    # tiles fitted to small shapes: strips and chunks to the next power of two, 16 at least
    fitted = moe.pick_config(1000, 8, 24, 40)
    assert fitted.block_m == 64 and fitted.gate_up == moe.Tile(32, 64, 8, 4)
    assert fitted.down == moe.Tile(64, 32, 8, 4)
    assert moe.pick_config(1000, 8, 8, 8).down == moe.Tile(16, 16, 8, 4)


def test_configs_refuse_shapes_the_kernels_cannot_run(kernels):
    moe = kernels.moe
    assert moe.GroupedConfig() == moe.GroupedConfig(16, moe.Tile(64, 64, 4, 3),
                                                    moe.Tile(64, 64, 4, 3))
    with pytest.raises(ValueError, match="block_m=8"):
        moe.GroupedConfig(8)
    with pytest.raises(ValueError, match="block_n=48"):
        moe.Tile(48, 64)
    with pytest.raises(ValueError, match="block_k=8"):
        moe.Tile(64, 8)
    for _, config in moe.CONFIGS:
        assert config.block_m in moe.BLOCK_MS
    assert [b for b, _ in moe.CONFIGS] == sorted(b for b, _ in moe.CONFIGS)
    assert moe.CONFIGS[-1][0] == math.inf  # every load has a row
