"""Paged varlen attention (``kernels.attention``) and the Triton attention backend vs the torch
reference, through the Triton interpreter (setup and the ``kernels`` fixture: conftest.py)."""

from __future__ import annotations

import pytest
import torch

from replaylm.attention.torch_ref import attention_ref
from replaylm.batch import BLOCK_SIZE
from replaylm.kernels import ref
from tests.attn_helpers import make_batch
from tests.kernels.helpers import rope_table


def run_attn(kernels, q, kc, vc, meta, **kw):
    return kernels.attn.paged_attention(
        q, kc, vc, meta.cu_seqlens_q, meta.kv_lens, meta.block_table, q.shape[-1] ** -0.5,
        max_q_len=meta.max_q_len, max_kv_len=meta.max_kv_len, **kw,
    )


def check_attn(out, q, kc, vc, meta, atol=2e-5):
    ref = attention_ref(q, kc, vc, meta.cu_seqlens_q_cpu, meta.kv_lens_cpu, meta.block_table,
                        q.shape[-1] ** -0.5)
    t_real = meta.cu_seqlens_q_cpu[-1]
    torch.testing.assert_close(out[:t_real], ref[:t_real], atol=atol, rtol=1e-4)
    # Padded tokens come back as zeros (deterministic, never NaN).
    assert torch.all(out[t_real:] == 0)


# A prefill chunk over a cached prefix, single-token decodes at block boundaries, a verify
# row, then padded tokens and empty request slots: everything one graph launch must handle.
MIXED_Q = [20, 1, 1, 1, 4, 1]
MIXED_KV = [33, 15, 16, 17, 37, 1]


@pytest.mark.parametrize("hq,hkv", [(2, 2), (8, 2)])
def test_mixed_batch(kernels, hq, hkv):
    q, kc, vc, meta = make_batch(MIXED_Q, MIXED_KV, hq=hq, hkv=hkv, d=32, pad_tokens=3,
                                 pad_slots=2)
    check_attn(run_attn(kernels, q, kc, vc, meta, num_splits=1), q, kc, vc, meta)


@pytest.mark.parametrize("block_m,block_n", [(16, 16), (64, 32), (128, 64)])
def test_tile_shapes(kernels, block_m, block_n):
    """Every tile height the config picker can choose, incl. the prefill tile, on one batch."""
    q, kc, vc, meta = make_batch(MIXED_Q, MIXED_KV, hq=8, hkv=2, d=16, pad_tokens=5,
                                 pad_slots=1, seed=1)
    cfg = kernels.attn.AttnConfig(block_m=block_m, block_n=block_n, num_warps=4, num_stages=1)
    check_attn(run_attn(kernels, q, kc, vc, meta, num_splits=1, config=cfg), q, kc, vc, meta)


@pytest.mark.parametrize("kv_len", [15, 16, 17, 33])
def test_block_boundaries(kernels, kv_len):
    q_lens = [1, kv_len, 3]
    q, kc, vc, meta = make_batch(q_lens, [kv_len] * 3, hq=4, hkv=1, d=64, seed=kv_len)
    check_attn(run_attn(kernels, q, kc, vc, meta), q, kc, vc, meta)


@pytest.mark.parametrize("hq,hkv,splits", [(2, 2, 3), (8, 2, 4), (4, 1, 32)])
def test_split_kv(kernels, hq, hkv, splits):
    """Flash-decoding path: decodes, a verify row and a short request (empty splits)."""
    q, kc, vc, meta = make_batch([1, 4, 1, 1], [200, 150, 5, 64], hq=hq, hkv=hkv, d=32,
                                 pad_tokens=2, pad_slots=1, seed=splits)
    cfg = kernels.attn.AttnConfig(block_m=16 * (hq // hkv), block_n=16, num_warps=4,
                                  num_stages=1)
    for _ in range(2):  # the second launch reuses the merge counters the first reset
        check_attn(run_attn(kernels, q, kc, vc, meta, num_splits=splits, config=cfg,
                            min_split_keys=16), q, kc, vc, meta)
        assert not kernels.attn._split_counters(q.device).any()
    # The tile's own minimum split length (256 keys by default): one split per context.
    check_attn(run_attn(kernels, q, kc, vc, meta, num_splits=splits, config=cfg), q, kc, vc,
               meta)


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("splits", [1, 4, 6])
def test_decode_attention_with_rope(kernels, qk_norm, splits):
    """Decode attention that normalises and rotates q and the new key itself and writes the
    new K/V = the rotary kernel's reference, then attention over the updated cache. This
    variant loads its first key block before the PDL wait and patches the new key into it,
    lets programs without keys leave before the wait, and merges four partials per round
    trip: 6 splits give a 200-key context five partials (a full round and a partial one),
    the short contexts leave most programs idle, and the padded rows must still be zeroed."""
    hq, hkv, d = 4, 2, 32
    kv_lens = [200, 17, 1, 64, 33]
    q, kc, vc, meta = make_batch([1] * len(kv_lens), kv_lens, hq=hq, hkv=hkv, d=d,
                                 pad_tokens=2, pad_slots=1, seed=11 + splits)
    g = torch.Generator().manual_seed(5)
    t = q.shape[0]
    k_new, v_new = torch.randn(2, t, hkv, d, generator=g)
    slots = torch.zeros(t, dtype=torch.int64)  # padded tokens: scratch block 0
    positions = torch.zeros(t, dtype=torch.int64)
    for i, kv in enumerate(kv_lens):
        positions[i] = kv - 1
        slots[i] = int(meta.block_table[i, (kv - 1) // BLOCK_SIZE]) * BLOCK_SIZE + (kv - 1) % BLOCK_SIZE
    cos_sin = rope_table(256, d)
    norms = {}
    if qk_norm:
        norms = dict(q_norm_weight=torch.randn(d, generator=g),
                     k_norm_weight=torch.randn(d, generator=g), eps=1e-6)
    ref_k, ref_v = kc.clone(), vc.clone()
    q_ref, _ = ref.rotary(q, k_new, positions, cos_sin, v=v_new, k_cache=ref_k,
                                        v_cache=ref_v, slot_mapping=slots, **norms)
    rope = kernels.attn.RopeInputs(k=k_new, v=v_new, positions=positions, cos_sin=cos_sin,
                                   slot_mapping=slots, **norms)
    cfg = kernels.attn.AttnConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
    out = run_attn(kernels, q, kc, vc, meta, num_splits=splits, min_split_keys=16, config=cfg,
                   rope=rope)
    # Every real request's new K/V is in the cache (block 0, the padding scratch, aside).
    torch.testing.assert_close(kc[1:], ref_k[1:])
    torch.testing.assert_close(vc[1:], ref_v[1:])
    check_attn(out, q_ref, ref_k, ref_v, meta)
    with pytest.raises(ValueError, match="max_q_len"):
        kernels.attn.paged_attention(q, kc, vc, meta.cu_seqlens_q, meta.kv_lens,
                                     meta.block_table, 1.0, max_q_len=2, max_kv_len=200,
                                     rope=rope)


def test_split_choice_is_host_only(kernels):
    q = torch.zeros(1, 32, 128)
    pick = kernels.attn.pick_num_splits
    assert pick(q, num_reqs=1, num_kv_heads=8, max_q_len=1, max_kv_len=32768, block_n=64) > 1
    assert pick(q, num_reqs=64, num_kv_heads=8, max_q_len=1, max_kv_len=32768, block_n=64) == 1
    assert pick(q, num_reqs=1, num_kv_heads=8, max_q_len=512, max_kv_len=32768, block_n=64) == 1
    # Few (request, KV head) pairs: the latency tile (64-key blocks, one stage); many: the
    # bandwidth tile. Both from host-known sizes only.
    attn = kernels.attn
    assert attn.few_programs(q, 1, 8) and not attn.few_programs(q, 64, 8)
    latency = attn.pick_config(1, 2, 128, latency_bound=True)
    assert (latency.block_n, latency.num_stages, latency.min_split_keys) == (64, 1, 64)
    assert attn.pick_config(1, 2, 128).block_n == 128
    # 64-wide heads keep the bandwidth tile (measured slower in the 1B model).
    assert attn.pick_config(1, 4, 64, latency_bound=True) == attn.pick_config(1, 4, 64)
    assert attn.pick_config(512, 2, 128, latency_bound=True) == attn.pick_config(512, 2, 128)


def test_ragged_tier_tile_holds_few_query_tokens(kernels):
    """A launch sized for a 64-token tier without GQA (a ragged graph's) takes 16-token
    tiles, as a decode launch does, not 64 rows of which a decode request fills one; a
    prefill chunk longer than a tile spans several and stays exact."""
    attn = kernels.attn
    assert attn.pick_config(64, 1, 128).block_m == attn.MAX_SHORT_TOKENS
    assert attn.pick_config(64, 1, 128).block_n == attn.pick_config(1, 1, 128).block_n
    assert attn.pick_config(32, 2, 128).block_m == 2 * attn.MAX_SHORT_TOKENS
    assert attn.pick_config(64, 4, 64) == attn.pick_config(4096, 4, 64)  # the prefill tile
    cfg = attn.pick_config(64, 1, 32)
    q, kc, vc, meta = make_batch([40, 1, 1, 9], [52, 17, 3, 30], hq=2, hkv=2, d=32,
                                 pad_tokens=2, pad_slots=1, seed=3)
    check_attn(run_attn(kernels, q, kc, vc, meta, num_splits=1, config=cfg), q, kc, vc, meta)


def test_backend_forward_and_warmup(kernels):
    backend = kernels.backend
    assert backend.name == "triton" and backend.graph_safe
    for rope, qk_norm in ((False, False), (True, False), (True, True)):
        backend.warmup(num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32,
                       device=torch.device("cpu"), rope=rope, qk_norm=qk_norm)
    q, kc, vc, meta = make_batch(MIXED_Q, MIXED_KV, hq=4, hkv=2, d=16, pad_tokens=2,
                                 pad_slots=2, seed=7)
    check_attn(backend.forward(q, kc, vc, meta, 16**-0.5), q, kc, vc, meta)
