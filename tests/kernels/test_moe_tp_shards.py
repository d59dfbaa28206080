"""The MoE kernels at tensor-parallel expert widths, through the Triton interpreter (fp32):
each rank's experts hold ``moe_intermediate_size / N`` rows of gate and up and as many
columns of down. Both routed paths (per-assignment GEMVs and grouped GEMMs) and the shared
expert's gated add take any width (their intermediate tiles are masked), so each rank's
result matches the reference on its shard, and the ranks' partial sums add up to the
unsharded layer."""

from __future__ import annotations

import pytest
import torch

from replaylm.kernels import ref
from tests.kernels.moe_cases import moe_case

# Full expert width, ranks: Qwen1.5-MoE's 1408 / 2 = 704 (11 tiles of 64; the GEMVs' down
# chunks of 512 leave a masked tail), the tiny Qwen3-MoE checkpoint's 48 / 2 = 24 and widths
# below and between the kernels' tiles (24 / 2 = 12, 40 / 2 = 20).
WIDTHS = [(1408, 2), (48, 2), (24, 2), (40, 2)]


def _shard(w_gate_up: torch.Tensor, w_down: torch.Tensor, rank: int, size: int):
    """Rank ``rank``'s experts: its rows of gate and of up, its columns of down."""
    i = w_down.shape[2]
    width = i // size
    rows = slice(rank * width, (rank + 1) * width)
    gate_up = torch.cat([w_gate_up[:, :i][:, rows], w_gate_up[:, i:][:, rows]], dim=1)
    return gate_up.contiguous(), w_down[:, :, rows].contiguous()


@pytest.mark.parametrize("full,size", WIDTHS)
@pytest.mark.parametrize("path", ["gemv", "grouped"])
def test_rank_shards_match_reference_and_sum_to_the_layer(kernels, full, size, path):
    t = 2 if path == "gemv" else 9  # the GEMVs serve few assignments, grouping more
    x, w_gate_up, w_down, weights, ids = moe_case(t, 6, 2, 32, full, seed=full + size,
                                                  normalize=True)
    total = torch.zeros_like(x)
    for rank in range(size):
        gate_up, down = _shard(w_gate_up, w_down, rank, size)
        if path == "gemv":
            # pick_config's gate/up strip at 704 columns is 4 wide (hundreds of interpreted
            # programs): a 32-wide one here; the down tiles are picked.
            strip = (32, 32, 4) if full > 512 else None
            got = kernels.moe_decode.gemv_moe(x, gate_up, down, weights, ids,
                                              gate_up_config=strip)
        else:
            got = kernels.moe.fused_moe(x, gate_up, down, weights, ids)
        torch.testing.assert_close(got, ref.fused_moe(x, gate_up, down, weights, ids),
                                   rtol=1e-4, atol=1e-5)
        total += got
    torch.testing.assert_close(total, ref.fused_moe(x, w_gate_up, w_down, weights, ids),
                               rtol=1e-4, atol=1e-5)


def test_shared_combine_of_partial_sums_is_the_layer(kernels):
    """``routed + sigmoid(g) * shared`` is linear in the partial sums: each rank combines
    its own, and the sum over ranks is the unsharded block."""
    g = torch.Generator().manual_seed(8)
    t, h, ranks = 3, 48, 2
    x = torch.randn(t, h, generator=g)
    gate_weight = torch.randn(1, h, generator=g) * 0.2
    routed = [torch.randn(t, h, generator=g) for _ in range(ranks)]
    shared = [torch.randn(t, h, generator=g) for _ in range(ranks)]
    total = sum(kernels.moe_route.shared_combine(r, s, x, gate_weight)
                for r, s in zip(routed, shared))
    torch.testing.assert_close(total, ref.shared_combine(sum(routed), sum(shared), x,
                                                         gate_weight), rtol=1e-5, atol=1e-5)
