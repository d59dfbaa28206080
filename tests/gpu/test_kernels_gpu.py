"""Triton kernels on the GPU (bf16/fp16, real head shapes, long contexts) vs torch references.

Run with ``pytest -m gpu tests/gpu/test_kernels_gpu.py``; skipped without CUDA/Triton.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

from tests.gpu.requires import compiled_triton  # noqa: E402

triton = compiled_triton()

from replaylm.attention.torch_ref import attention_ref  # noqa: E402
from replaylm.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from replaylm.batch import BLOCK_SIZE, AttentionMetadata  # noqa: E402
from replaylm.kernels import attention as attn  # noqa: E402
from replaylm.kernels import elementwise, ops, ref, skinny, tuner  # noqa: E402
from tests import attn_helpers  # noqa: E402

DEV = torch.device("cuda")


def make_batch(q_lens, kv_lens, **kw):
    """``tests.attn_helpers.make_batch`` on the GPU."""
    return attn_helpers.make_batch(q_lens, kv_lens, device=DEV, **kw)


def linear_fp32(x, w, b=None):
    """``ref.linear`` accumulated in fp32, rounded to ``x``'s dtype."""
    return ref.linear(x.float(), w.float(), None if b is None else b.float()).to(x.dtype)


def check(out, q, kc, vc, meta, tol=2e-2):
    ref = attention_ref(q.float(), kc.float(), vc.float(), meta.cu_seqlens_q_cpu,
                        meta.kv_lens_cpu, meta.block_table, q.shape[-1] ** -0.5)
    t = meta.cu_seqlens_q_cpu[-1]
    torch.testing.assert_close(out[:t].float(), ref[:t], atol=tol, rtol=tol)
    assert torch.all(out[t:] == 0)


def run(q, kc, vc, meta, **kw):
    return attn.paged_attention(q, kc, vc, meta.cu_seqlens_q, meta.kv_lens, meta.block_table,
                                q.shape[-1] ** -0.5, max_q_len=meta.max_q_len,
                                max_kv_len=meta.max_kv_len, **kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("hq,hkv", [(8, 8), (32, 8), (32, 4)])
def test_mixed_batch(dtype, d, hq, hkv):
    # Chunked prefill over a prefix, decodes at and around block edges, verify rows, padding.
    q_lens = [300, 1, 1, 1, 5, 1, 64]
    kv_lens = [1000, 15, 16, 4097, 40, 1, 64]
    q, kc, vc, meta = make_batch(q_lens, kv_lens, hq=hq, hkv=hkv, d=d, dtype=dtype,
                                 pad_tokens=7, pad_slots=3)
    check(run(q, kc, vc, meta), q, kc, vc, meta)


@pytest.mark.parametrize("splits", [None, 1, 8, 32])
@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (16, 8, 64), (8, 1, 128)])
def test_long_context_decode(splits, hq, hkv, d):
    q_lens = [1, 1, 4]
    kv_lens = [32768, 9000, 20001]
    q, kc, vc, meta = make_batch(q_lens, kv_lens, hq=hq, hkv=hkv, d=d, dtype=torch.bfloat16,
                                 pad_tokens=1, pad_slots=1, seed=1)
    out = run(q, kc, vc, meta, num_splits=splits)
    check(out, q, kc, vc, meta)
    # The last split to arrive merges; which one that is varies, the result must not.
    from replaylm.kernels.attention import _split_counters

    for _ in range(20):
        assert torch.equal(run(q, kc, vc, meta, num_splits=splits), out)
    assert not _split_counters(q.device).any()


@pytest.mark.parametrize("splits", [None, 1, 8])
@pytest.mark.parametrize("hq,hkv,d,qk_norm", [(16, 8, 128, True), (32, 8, 64, False)])
def test_decode_attention_with_rope_gpu(splits, hq, hkv, d, qk_norm):
    """Decode attention doing the rotary kernel's work itself = rotary kernel, then attention
    (same rounding steps; the q/k norm's sum of squares may reduce in another order, so
    within one bf16 ulp rather than bit for bit)."""
    kv_lens = [9000, 17, 300, 1]
    q, kc, vc, meta = make_batch([1] * 4, kv_lens, hq=hq, hkv=hkv, d=d, dtype=torch.bfloat16,
                                 pad_tokens=2, pad_slots=1, seed=3)
    t = q.shape[0]
    k_new, v_new = torch.randn(2, t, hkv, d, device=DEV, dtype=torch.bfloat16)
    positions = torch.zeros(t, dtype=torch.int64, device=DEV)
    slots = torch.zeros(t, dtype=torch.int64, device=DEV)
    for i, kv in enumerate(kv_lens):
        positions[i] = kv - 1
        slots[i] = meta.block_table[i, (kv - 1) // BLOCK_SIZE] * BLOCK_SIZE + (kv - 1) % BLOCK_SIZE
    inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, device=DEV).float() / d))
    freqs = torch.outer(torch.arange(10000, device=DEV).float(), inv)
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], -1)
    norms = {}
    if qk_norm:
        norms = dict(q_norm_weight=torch.randn(d, device=DEV, dtype=torch.bfloat16),
                     k_norm_weight=torch.randn(d, device=DEV, dtype=torch.bfloat16), eps=1e-6)
    kc2, vc2 = kc.clone(), vc.clone()
    q_rot, _ = elementwise.rotary(q, k_new, positions, cos_sin, v=v_new, k_cache=kc2, v_cache=vc2,
                            slot_mapping=slots, **norms)
    want = run(q_rot, kc2, vc2, meta, num_splits=splits)
    rope = attn.RopeInputs(k=k_new, v=v_new, positions=positions, cos_sin=cos_sin,
                           slot_mapping=slots, **norms)
    got = run(q, kc, vc, meta, num_splits=splits, rope=rope)
    torch.testing.assert_close(kc[1:], kc2[1:], atol=2e-2, rtol=1e-2)
    assert torch.equal(vc[1:], vc2[1:])
    torch.testing.assert_close(got, want, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("d", [64, 128])
def test_prefill_vs_sdpa(d):
    n, hq, hkv = 2048, 32, 8
    q, kc, vc, meta = make_batch([n], [n], hq=hq, hkv=hkv, d=d, dtype=torch.bfloat16)
    out = run(q, kc, vc, meta)
    bt = meta.block_table[0].long()
    k = kc[bt].flatten(0, 1)[:n].repeat_interleave(hq // hkv, 1)
    v = vc[bt].flatten(0, 1)[:n].repeat_interleave(hq // hkv, 1)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
    ).transpose(0, 1)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


def test_cuda_graph_replay():
    """Capture once at padded sizes, replay for a different mix of requests."""
    hq, hkv, d, dtype = 32, 8, 128, torch.bfloat16
    backend = TritonAttentionBackend()
    backend.warmup(num_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=dtype, device=DEV)
    t_pad, s = 16, 6
    q1, kc, vc, m1 = make_batch([1, 4, 1, 1], [900, 300, 17, 5000], hq=hq, hkv=hkv, d=d,
                                dtype=dtype, pad_tokens=t_pad - 7, pad_slots=s - 4, seed=3)
    q2, _, _, m2 = make_batch([1] * 5, [100, 16, 4000, 2, 33], hq=hq, hkv=hkv, d=d,
                              dtype=dtype, pad_tokens=t_pad - 5, pad_slots=s - 5, seed=4)
    m2.block_table = m2.block_table.clamp(max=kc.shape[0] - 1)
    # Static buffers sized for the tier; the graph bakes in their addresses.
    st_q = q1.clone()
    st = AttentionMetadata(m1.cu_seqlens_q.clone(), m1.kv_lens.clone(),
                           torch.zeros(s, 400, dtype=torch.int32, device=DEV),
                           m1.slot_mapping.clone(), t_pad, s, max_q_len=8, max_kv_len=6400)
    st.block_table[:, : m1.block_table.shape[1]] = m1.block_table
    backend.forward(st_q, kc, vc, st, d**-0.5)  # eager run of the same variant
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        st_out = backend.forward(st_q, kc, vc, st, d**-0.5)
    for q, m in ((q1, m1), (q2, m2)):
        st_q.copy_(q)
        st.cu_seqlens_q.copy_(m.cu_seqlens_q)
        st.kv_lens.copy_(m.kv_lens)
        st.block_table.zero_()
        st.block_table[:, : m.block_table.shape[1]] = m.block_table
        graph.replay()
        eager = backend.forward(st_q, kc, vc, st, d**-0.5)
        assert torch.equal(st_out, eager)  # replay is bit-identical to eager
        check(st_out.clone(), q, kc, vc, m)


@pytest.mark.smoke
def test_write_kv_strided():
    t, hq, hkv, d = 37, 32, 8, 128
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device=DEV, dtype=torch.bfloat16)
    k = qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
    v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
    slots = torch.randperm(64, device=DEV)[:t] + 16
    slots[-3:] = 0
    caches = [torch.zeros(6, BLOCK_SIZE, hkv, d, device=DEV, dtype=torch.bfloat16) for _ in range(4)]
    TritonAttentionBackend().write_kv(k, v, caches[0], caches[1], slots)
    ref.write_kv(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0][1:], caches[2][1:]) and torch.equal(caches[1][1:], caches[3][1:])


@pytest.mark.smoke
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_kernels(dtype):
    g = torch.Generator(device=DEV).manual_seed(0)
    t, h, inter = 33, 4096, 14336
    x = torch.randn(t, h, device=DEV, dtype=dtype, generator=g)
    res = torch.randn(t, h, device=DEV, dtype=dtype, generator=g)
    w = torch.randn(h, device=DEV, dtype=dtype, generator=g)
    for r in (None, res):
        out, new_res = elementwise.add_rms_norm(x, r, w, 1e-5)
        ref_out, ref_res = ref.add_rms_norm(x, r, w, 1e-5)
        assert torch.equal(new_res, ref_res)
        torch.testing.assert_close(out, ref_out, atol=2e-2, rtol=1e-2)
        rows = torch.tensor([32, 0, 7, 7], device=DEV)  # a step's final norm on its logits rows
        out, new_res = elementwise.add_rms_norm(x, r, w, 1e-5, rows=rows)
        ref_out, ref_res = ref.add_rms_norm(x, r, w, 1e-5, rows=rows)
        assert torch.equal(new_res, ref_res)
        torch.testing.assert_close(out, ref_out, atol=2e-2, rtol=1e-2)
    gate_up = torch.randn(t, 2 * inter, device=DEV, dtype=dtype, generator=g)
    torch.testing.assert_close(elementwise.silu_and_mul(gate_up), ref.silu_and_mul(gate_up),
                               atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("t", [3, 29])  # a program per head; per group of heads
def test_rotary_fused(qk_norm, d, t):
    dtype, hq, hkv = torch.bfloat16, 16, 8
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device=DEV, dtype=dtype)
    q = qkv[:, :hq * d].view(t, hq, d)
    k = qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
    v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
    inv = 1.0 / (500000 ** (torch.arange(0, d, 2, device=DEV).float() / d))
    freqs = torch.outer(torch.arange(40000, device=DEV).float(), inv)
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], -1)
    positions = torch.randint(0, 40000, (t,), device=DEV)
    kw = {}
    if qk_norm:
        kw = dict(q_norm_weight=torch.randn(d, device=DEV, dtype=dtype),
                  k_norm_weight=torch.randn(d, device=DEV, dtype=dtype), eps=1e-6)
    caches = [torch.zeros(4, BLOCK_SIZE, hkv, d, device=DEV, dtype=dtype) for _ in range(4)]
    slots = torch.arange(16, 16 + t, device=DEV)
    qo, ko = elementwise.rotary(q, k, positions, cos_sin, v=v, k_cache=caches[0],
                                v_cache=caches[1], slot_mapping=slots, **kw)
    qr, kr = ref.rotary(q, k, positions, cos_sin, v=v, k_cache=caches[2], v_cache=caches[3],
                        slot_mapping=slots, **kw)
    torch.testing.assert_close(qo, qr, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(ko, kr, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(caches[0], caches[2], atol=2e-2, rtol=1e-2)
    assert torch.equal(caches[1], caches[3])


@pytest.mark.parametrize("m,n,k", [(2, 6144, 4096), (4, 4096, 14336), (8, 4096, 4096)])
def test_skinny_split_k_bf16_gpu(m, n, k):
    """Every split-K tile the tuner times for bf16 weights, forced at Llama 3 8B's
    projections (bias included): against fp32 torch, repeatable to the bit."""
    g = torch.Generator(device=DEV).manual_seed(n + m)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16, generator=g) * 0.02
    b = torch.randn(n, device=DEV, dtype=torch.bfloat16, generator=g)
    want = linear_fp32(x, w, b)
    tiles = [c for c in tuner.candidates(m, k) if len(c) == 5]
    assert tiles
    for cfg in tiles:
        got = skinny.skinny_linear(x, w, b, config=cfg)
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2, msg=f"tile {cfg}")
        assert torch.equal(got, skinny.skinny_linear(x, w, b, config=cfg))


@pytest.mark.parametrize("m", [1, 2, 5, 8, 16])
@pytest.mark.parametrize("n,k", [(3072, 2048), (1024, 3072), (6144, 1024), (4096, 14336)])
def test_skinny_linear_gpu(m, n, k):
    """The decode projection kernel vs fp32 torch, bf16 weights; repeatable to the bit."""
    g = torch.Generator(device=DEV).manual_seed(n + m)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16, generator=g) * 0.02
    b = torch.randn(n, device=DEV, dtype=torch.bfloat16, generator=g)
    got = skinny.skinny_linear(x, w, b)
    torch.testing.assert_close(got, linear_fp32(x, w, b), atol=2e-2, rtol=2e-2)
    assert torch.equal(got, skinny.skinny_linear(x, w, b))
    chosen = ops.linear(x, w, b)  # measures both once, then keeps the faster
    if m <= 8:
        assert ("plain", ops.row_block(m), n, k, x.dtype, True) in tuner.LINEAR_CHOICES
    torch.testing.assert_close(chosen, linear_fp32(x, w, b), atol=2e-2, rtol=2e-2)
    assert torch.equal(chosen, ops.linear(x, w, b))


@pytest.mark.parametrize("m", [1, 3])
def test_lm_head_linear_gpu(m):
    """The LM head through ``linear`` into a given logits buffer (the graphs' shared one):
    whichever of cuBLAS and the skinny kernel it picks, the buffer holds the product."""
    g = torch.Generator(device=DEV).manual_seed(m)
    x = torch.randn(m, 1024, device=DEV, dtype=torch.bfloat16, generator=g)
    w = torch.randn(151936, 1024, device=DEV, dtype=torch.bfloat16, generator=g) * 0.02
    out = torch.full((m, 151936), float("nan"), device=DEV, dtype=torch.bfloat16)
    assert ops.linear(x, w, out=out) is out
    torch.testing.assert_close(out, linear_fp32(x, w), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("n,k", [(4096, 1024), (2048, 8192)])
def test_fused_prologue_linear_gpu(m, n, k):
    """Add + RMSNorm and SiLU·mul folded into the projection, bf16: the new residual is
    exact, the output matches the separate ops within a bf16 ulp of the input and fp32
    accumulation order, and the layers' dispatchers record their measured choices."""
    g = torch.Generator(device=DEV).manual_seed(n + k + m)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=g)
    res = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=g)
    nw = torch.rand(k, device=DEV, dtype=torch.bfloat16, generator=g) + 0.5
    w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16, generator=g) * 0.02
    y, new_res = skinny.skinny_norm_linear(x, res, nw, 1e-6, w)
    normed, ref_res = ref.add_rms_norm(x, res, nw, 1e-6)
    ref_y = linear_fp32(normed, w)
    assert torch.equal(new_res, ref_res)
    torch.testing.assert_close(y, ref_y, atol=2e-2, rtol=2e-2)
    assert torch.equal(y, skinny.skinny_norm_linear(x, res, nw, 1e-6, w)[0])
    y, new_res = ops.norm_linear(x, res, nw, 1e-6, w)
    torch.testing.assert_close(y, ref_y, atol=2e-2, rtol=2e-2)
    assert torch.equal(new_res, ref_res)
    assert ("norm", ops.row_block(m), n, k, x.dtype, False) in tuner.LINEAR_CHOICES

    gate_up = torch.randn(m, 2 * k, device=DEV, dtype=torch.bfloat16, generator=g)
    want = linear_fp32(ref.silu_and_mul(gate_up), w)
    torch.testing.assert_close(skinny.skinny_silu_linear(gate_up, w), want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(ops.silu_linear(gate_up, w), want, atol=2e-2, rtol=2e-2)
    assert ("silu", ops.row_block(m), n, k, x.dtype, False) in tuner.LINEAR_CHOICES


@pytest.mark.smoke
def test_argmax_rows_gpu():
    """The one-launch argmax equals torch.argmax on the device: first index on ties, NaN
    wins; repeated launches reuse the arrival counters."""
    from replaylm.kernels.argmax import _counters
    from replaylm.sampling.sampler import argmax_rows

    g = torch.Generator(device=DEV).manual_seed(1)
    for vocab in (128256, 151936, 32000, 4000):
        for rows in (1, 7, 300):
            x = torch.randint(0, 40, (rows, vocab), device=DEV, generator=g).to(torch.bfloat16)
            x[0, vocab // 2] = float("nan")
            for _ in range(3):
                assert torch.equal(argmax_rows(x), x.argmax(-1))
            dest = torch.full((rows + 3,), -1, dtype=torch.int64, device=DEV)
            slots = torch.randperm(rows + 3, device=DEV, generator=g)[:rows]
            got = argmax_rows(x, dest, slots)  # also into dest[slots], as last_token
            assert torch.equal(got, x.argmax(-1)) and torch.equal(dest[slots], got)
            assert int((dest == -1).sum()) == 3
    assert not _counters(x.device).any()


def test_sample_rows_gpu():
    """The one-launch sampler against ``counter_rng.race`` on the device, at a 128k vocab
    and up to 300 rows, greedy, random and top-k rows mixed: the same tokens except where the
    two keys tie to the device's ``log`` rounding (checked in float64); with a top-40
    threshold every token is among the row's top 40."""
    from replaylm.kernels import counter_rng as rng
    from replaylm.kernels.argmax import _counters
    from replaylm.kernels.sample import sample

    g = torch.Generator(device=DEV).manual_seed(2)
    vocab = 128256
    vhash = rng.vocab_hash(vocab, DEV)
    temps = torch.tensor([0.0, 0.05, 0.7, 1.0, 1.5, 0.0, 0.9, 3.0], device=DEV)
    keys = torch.tensor([rng.seed_key(s) for s in range(8)], dtype=torch.int64, device=DEV)
    for rows in (1, 64, 300):
        x = (torch.randn(rows, vocab, device=DEV, generator=g) * 4).to(torch.bfloat16)
        slots = torch.randint(0, 8, (rows,), device=DEV, generator=g)
        slots[0] = 2  # a random row in every case
        out_pos = torch.randint(0, 1 << 20, (rows,), device=DEV, generator=g)
        t = temps[slots]
        scaled = x.float() / torch.where(t == 0, 1.0, t)[:, None]
        for threshold in (None, scaled.topk(40, dim=-1).values[:, -1]):
            got = sample(x, slots, out_pos, temps, keys, threshold)
            want = rng.race(x, t, keys[slots], out_pos, vhash, threshold)
            differ = (got != want).nonzero().flatten().tolist()
            assert len(differ) <= max(1, rows // 50), differ
            u = rng.uniforms(rng.row_keys(keys[slots], out_pos), vhash).double()
            key = scaled.double() - (-u.log()).log()
            for r in differ:
                assert abs(float(key[r, got[r]] - key[r, want[r]])) < 1e-5
            if threshold is not None:
                assert bool((scaled.gather(1, got[:, None])[:, 0] >= threshold).all())
    assert not _counters(x.device).any()


def test_gather_step_inputs_gpu():
    """A step's ids, block table and embedding rows in one launch = the torch ops."""
    from replaylm.kernels.step_inputs import gather_step_inputs

    g = torch.Generator(device=DEV).manual_seed(2)
    for vocab, hidden, tokens, reqs, blocks in ((151936, 1024, 1, 1, 256), (128256, 4096, 300, 40, 2561)):
        slots = 64
        source = torch.randint(0, vocab, (slots + 1 + tokens,), device=DEV, generator=g)
        gather = torch.randint(0, slots + 1 + tokens, (tokens,), device=DEV, generator=g)
        tables = torch.randint(0, 10**6, (slots + 1, blocks), device=DEV, generator=g,
                               dtype=torch.int32)
        req_slots = torch.randint(0, slots + 1, (reqs,), device=DEV, generator=g)
        emb = torch.randn(vocab, hidden, device=DEV, dtype=torch.bfloat16, generator=g)
        ids = torch.empty(tokens, dtype=torch.int64, device=DEV)
        bt = torch.empty(reqs, blocks, dtype=torch.int32, device=DEV)
        out = gather_step_inputs(source, gather, ids, tables, req_slots, bt, emb)
        assert torch.equal(ids, source[gather]) and torch.equal(bt, tables[req_slots])
        assert torch.equal(out, emb[ids])
