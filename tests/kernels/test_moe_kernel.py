"""The grouped fused-MoE kernels (``kernels.moe``) vs ``ref.fused_moe``, through the Triton
interpreter: random routing, experts without tokens, every token on one expert, batch 1."""

from __future__ import annotations

import pytest
import torch

from replaylm.graphs.stand_in import no_host_sync
from replaylm.kernels import ref
from tests.kernels.moe_cases import moe_case

CASES = {
    # t, e, k, h, i, per-expert logit bias
    "random": (37, 8, 2, 48, 40, None),
    "unused_experts": (21, 10, 3, 32, 24, torch.tensor([-50.0] * 4 + [0.0] * 6)),
    "one_expert": (40, 6, 1, 32, 32, torch.tensor([0.0, 0.0, 80.0, 0.0, 0.0, 0.0])),
    "batch_1": (1, 12, 4, 64, 48, None),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_grouped_moe_matches_reference(kernels, case):
    t, e, k, h, i, bias = CASES[case]
    x, w_gate_up, w_down, weights, ids = moe_case(t, e, k, h, i, seed=len(case), bias=bias)
    if case == "unused_experts":
        assert (ids >= 4).all()
    if case == "one_expert":
        assert (ids == 2).all()
    got = kernels.moe.fused_moe(x, w_gate_up, w_down, weights, ids, block_n=32, block_k=32)
    torch.testing.assert_close(got, ref.fused_moe(x, w_gate_up, w_down, weights, ids),
                               rtol=1e-4, atol=1e-5)


def test_alignment_groups_by_expert_in_fixed_tiles_without_host_sync(kernels):
    moe = kernels.moe
    ids = torch.tensor([[3, 1], [3, 0], [1, 3], [3, 2]])  # expert 3 four times, 4 unused
    with no_host_sync("moe align"):
        slot_rows, tile_expert = moe.align(ids, num_experts=5, block_m=2)
    tiles = moe.max_tiles(8, 5, 2)
    assert tiles == 9 and slot_rows.shape == (18,) and tile_expert.shape == (9,)
    # expert 0: one slot, expert 1: two, expert 2: one, expert 3: four (two tiles)
    assert tile_expert.tolist() == [0, 1, 2, 3, 3, -1, -1, -1, -1]
    flat = ids.flatten()
    used = slot_rows[: 5 * 2].view(5, 2)
    for tile, expert in enumerate(tile_expert[:5].tolist()):
        real = [int(r) for r in used[tile] if r < 8]
        assert real and all(int(flat[r]) == expert for r in real)
    assert sorted(int(r) for r in slot_rows if r < 8) == list(range(8))  # each exactly once


def test_batch_1_tiles_read_only_the_chosen_experts(kernels):
    ids = torch.tensor([[7, 2, 9, 0]])
    slot_rows, tile_expert = kernels.moe.align(ids, num_experts=60)
    assert sorted(tile_expert.tolist()) == [0, 2, 7, 9]  # 4 tiles, one per chosen expert
