"""The elementwise decode kernels (``kernels.elementwise``): add + RMSNorm, SiLU·mul and rotary (with
q/k norm and the KV write), vs their torch references, through the Triton interpreter."""

from __future__ import annotations

import pytest
import torch

from replaylm.batch import BLOCK_SIZE
from replaylm.kernels import ref
from tests.kernels.helpers import rope_table


@pytest.mark.parametrize("with_residual", [False, True])
def test_fused_add_rmsnorm(kernels, with_residual):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 48, generator=g)
    res = torch.randn(5, 48, generator=g) if with_residual else None
    w = torch.randn(48, generator=g)
    out, new_res = kernels.elementwise.add_rms_norm(x, res, w, 1e-6)
    ref_out, ref_res = ref.add_rms_norm(x, res, w, 1e-6)
    torch.testing.assert_close(new_res, ref_res)
    torch.testing.assert_close(out, ref_out)


@pytest.mark.parametrize("with_residual", [False, True])
def test_fused_add_rmsnorm_rows(kernels, with_residual):
    """With ``rows`` (a step's final norm, on its logits rows only): those rows, in order,
    repeats allowed, as the reference computes after an index_select."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 48, generator=g)
    res = torch.randn(6, 48, generator=g) if with_residual else None
    w = torch.randn(48, generator=g)
    rows = torch.tensor([5, 0, 3, 3])
    out, new_res = kernels.elementwise.add_rms_norm(x, res, w, 1e-6, rows=rows)
    assert out.shape == (4, 48)
    ref_out, ref_res = ref.add_rms_norm(x, res, w, 1e-6, rows=rows)
    full_out, _ = ref.add_rms_norm(x, res, w, 1e-6)
    torch.testing.assert_close(ref_out, full_out[rows])
    torch.testing.assert_close(new_res, ref_res)
    torch.testing.assert_close(out, ref_out)


def test_silu_and_mul(kernels):
    gate_up = torch.randn(3, 2 * 40, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(kernels.elementwise.silu_and_mul(gate_up),
                               ref.silu_and_mul(gate_up))


@pytest.mark.parametrize("qk_norm,write,t", [(False, False, 5), (True, False, 5), (True, True, 5),
                                            (True, True, 20), (False, True, 20)])
def test_rotary(kernels, qk_norm, write, t):
    """Decode-sized steps run a program per head; larger ones (t > 16) a program per group
    of heads, here one partly masked group for q and one for k."""
    g = torch.Generator().manual_seed(6)
    hq, hkv, d = 6, 2, 32
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g)
    q = qkv[:, :hq * d].view(t, hq, d)
    k = qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
    v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
    positions = torch.tensor([0, 7, 8, 30, 2] * (t // 5))
    cos_sin = rope_table(32, d)
    kw = {}
    if qk_norm:
        kw.update(q_norm_weight=torch.randn(d, generator=g), k_norm_weight=torch.randn(d, generator=g),
                  eps=1e-6)
    caches = [torch.zeros(3, BLOCK_SIZE, hkv, d) for _ in range(4)]
    # Distinct cache slots, one token without a slot (-1).
    slots = torch.randperm(3 * BLOCK_SIZE, generator=g)[:t]
    slots[3] = -1
    out = kernels.elementwise.rotary(q, k, positions, cos_sin, **kw,
                                     **(dict(v=v, k_cache=caches[0], v_cache=caches[1],
                                             slot_mapping=slots) if write else {}))
    want = ref.rotary(q, k, positions, cos_sin, **kw)
    torch.testing.assert_close(out[0], want[0])
    torch.testing.assert_close(out[1], want[1])
    if write:  # the kernel skips the token without a slot; the reference writes the others
        keep = slots >= 0
        ref.write_kv(want[1][keep], v[keep], caches[2], caches[3], slots[keep])
        torch.testing.assert_close(caches[0], caches[2])
        torch.testing.assert_close(caches[1], caches[3])
        written = slots[slots >= 0]
        assert (caches[0].view(-1, hkv, d)[written].abs().sum(-1) > 0).all()


def test_rotary_launch_shape_overrides(kernels):
    """The rotary launch shape can be set (for latency sweeps): any power-of-two head group
    and warp count gives the same result, a partly masked last group included."""
    g = torch.Generator().manual_seed(9)
    t, hq, hkv, d = 3, 6, 2, 32
    q, k = torch.randn(t, hq, d, generator=g), torch.randn(t, hkv, d, generator=g)
    positions = torch.tensor([0, 5, 31])
    cos_sin = rope_table(32, d)
    want = ref.rotary(q, k, positions, cos_sin)
    for hp, warps in ((1, 1), (2, 2), (4, 1), (8, 4)):
        out = kernels.elementwise.rotary(q, k, positions, cos_sin, heads_per_program=hp,
                                         num_warps=warps)
        torch.testing.assert_close(out[0], want[0])
        torch.testing.assert_close(out[1], want[1])
    with pytest.raises(AssertionError, match="power of two"):
        kernels.elementwise.rotary(q, k, positions, cos_sin, heads_per_program=3)
