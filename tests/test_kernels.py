"""Triton kernels vs their torch references, on CPU through the Triton interpreter (fp32).

Triton picks the interpreter when ``triton`` itself is imported (``tl.sum`` & co. are jitted
then) and when each kernel is decorated, so ``TRITON_INTERPRET=1`` must be set before the
first ``import triton``. This module sets it when it is the first to import Triton on a
machine without CUDA (importing torch first is fine: torch does not import Triton). If
Triton was already imported without the interpreter (another test module got there first, or
a CUDA machine, where the GPU tests need compiled kernels), the tests here skip and one test
reruns this file in a fresh interpreter-mode subprocess instead.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

_CHILD_FLAG = "REPLAYLM_KERNEL_TESTS_CHILD"
if "triton" not in sys.modules and (os.environ.get(_CHILD_FLAG) or not torch.cuda.is_available()):
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from replaylm.attention.backend import BLOCK_SIZE  # noqa: E402
from replaylm.attention.torch_ref import attention_ref  # noqa: E402
from tests.attn_helpers import make_batch  # noqa: E402

IN_PROCESS = isinstance(triton.language.sum, InterpretedFunction)
# gemv before fused: fused re-exports gemv's ``linear`` at import.
_MODULES = ("replaylm.kernels.attention", "replaylm.kernels.kv_write", "replaylm.kernels.gemv",
            "replaylm.kernels.fused", "replaylm.kernels.argmax", "replaylm.kernels.step_inputs")


def test_interpreter_suite_in_subprocess():
    """Fallback when Triton was imported compiled-mode before this module: rerun it fresh."""
    if IN_PROCESS:
        pytest.skip("interpreter active in this process; tests run directly")
    env = {**os.environ, "TRITON_INTERPRET": "1", _CHILD_FLAG: "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-m", "not gpu"],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]


def _index_shim():
    """Triton 3.6's interpreter turns a scalar into ``int(array_of_shape_1)``, which numpy
    >= 2.4 refuses, so kernels with runtime loop bounds fail; patch in a 0-d conversion.
    Returns an undo callable."""
    from triton.runtime import interpreter

    orig = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
    return lambda: setattr(interpreter, "_patch_lang_tensor", orig)


@pytest.fixture(scope="module")
def kernels():
    if not IN_PROCESS:
        pytest.skip("Triton was imported without the interpreter; see the subprocess test")
    undo_shim = _index_shim()
    mods = []
    for name in _MODULES:
        mod = importlib.import_module(name)
        probe = next(v for k, v in vars(mod).items() if k.endswith("_kernel"))
        if not isinstance(probe, InterpretedFunction):  # imported before the interpreter
            mod = importlib.reload(mod)
        mods.append(mod)
    from replaylm.attention.triton_backend import TritonAttentionBackend

    attn, kvw, gemv, fused, argmax, step_inputs = mods
    yield SimpleNamespace(attn=attn, kvw=kvw, gemv=gemv, fused=fused, argmax=argmax,
                          step_inputs=step_inputs, backend=TritonAttentionBackend())
    undo_shim()




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
    cos_sin = _rope_table(256, d)
    norms = {}
    if qk_norm:
        norms = dict(q_norm_weight=torch.randn(d, generator=g),
                     k_norm_weight=torch.randn(d, generator=g), eps=1e-6)
    ref_k, ref_v = kc.clone(), vc.clone()
    q_ref, _ = kernels.fused.rotary_ref(q, k_new, positions, cos_sin, v=v_new, k_cache=ref_k,
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


def test_backend_forward_and_warmup(kernels):
    backend = kernels.backend
    assert backend.name == "triton" and backend.graph_safe
    for rope, qk_norm in ((False, False), (True, False), (True, True)):
        backend.warmup(num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32,
                       device=torch.device("cpu"), rope=rope, qk_norm=qk_norm)
    q, kc, vc, meta = make_batch(MIXED_Q, MIXED_KV, hq=4, hkv=2, d=16, pad_tokens=2,
                                 pad_slots=2, seed=7)
    check_attn(backend.forward(q, kc, vc, meta, 16**-0.5), q, kc, vc, meta)


def test_write_kv(kernels):
    from replaylm.attention.torch_ref import write_kv_ref

    g = torch.Generator().manual_seed(3)
    t, hkv, d = 7, 3, 16
    qkv = torch.randn(t, (4 + 2 * hkv) * d, generator=g)
    k = qkv[:, 4 * d:(4 + hkv) * d].view(t, hkv, d)  # strided view, as the model passes it
    v = qkv[:, (4 + hkv) * d:].view(t, hkv, d)
    slots = torch.tensor([17, 18, 40, 3, 0, 0, 63], dtype=torch.int64)  # last 2 padded → block 0
    caches = [torch.zeros(4, BLOCK_SIZE, hkv, d) for _ in range(4)]
    kernels.backend.write_kv(k, v, caches[0], caches[1], slots)
    write_kv_ref(k, v, caches[2], caches[3], slots)
    torch.testing.assert_close(caches[0][1:], caches[2][1:], rtol=0, atol=0)
    torch.testing.assert_close(caches[1][1:], caches[3][1:], rtol=0, atol=0)


@pytest.mark.parametrize("with_residual", [False, True])
def test_fused_add_rmsnorm(kernels, with_residual):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 48, generator=g)
    res = torch.randn(5, 48, generator=g) if with_residual else None
    w = torch.randn(48, generator=g)
    out, new_res = kernels.fused.fused_add_rmsnorm(x, res, w, 1e-6)
    ref_out, ref_res = kernels.fused.fused_add_rmsnorm_ref(x, res, w, 1e-6)
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
    out, new_res = kernels.fused.fused_add_rmsnorm(x, res, w, 1e-6, rows=rows)
    assert out.shape == (4, 48)
    ref_out, ref_res = kernels.fused.fused_add_rmsnorm_ref(x, res, w, 1e-6, rows=rows)
    full_out, _ = kernels.fused.fused_add_rmsnorm_ref(x, res, w, 1e-6)
    torch.testing.assert_close(ref_out, full_out[rows])
    torch.testing.assert_close(new_res, ref_res)
    torch.testing.assert_close(out, ref_out)


@pytest.mark.parametrize("m,n,k,bias", [(1, 24, 40, False), (3, 37, 64, True),
                                        (8, 16, 100, False), (9, 8, 16, False)])
def test_skinny_linear(kernels, m, n, k, bias):
    """Few-row matmul (the decode projections) vs fp32 torch; more rows than MAX_M take
    F.linear. The layers' ``linear`` is this kernel."""
    g = torch.Generator().manual_seed(m * 100 + n)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    got = kernels.gemv.skinny_linear(x, w, b)
    torch.testing.assert_close(got, kernels.gemv.skinny_linear_ref(x, w, b), rtol=1e-5, atol=1e-4)
    # Non-contiguous rows (a flattened view) and an explicit tile config.
    wide = torch.randn(m, 2 * k, generator=g)[:, :k]
    got = kernels.gemv.skinny_linear(wide, w, b, config=(16, 8, 16, 4))
    torch.testing.assert_close(got, kernels.gemv.skinny_linear_ref(wide, w, b), rtol=1e-5,
                               atol=1e-4)
    # Into a given output (the graphs' shared logits buffer), kernel and torch paths alike.
    for cfg in ((16, 8, 16, 4), None):
        out = torch.full((m, n), float("nan"))
        got = kernels.gemv.skinny_linear(x, w, b, config=cfg, out=out)
        assert got is out or m > kernels.gemv.MAX_M
        torch.testing.assert_close(out, kernels.gemv.skinny_linear_ref(x, w, b), rtol=1e-5,
                                   atol=1e-4)
    # The layers' ``linear`` is the measured dispatcher; off CUDA it is plain F.linear.
    assert kernels.fused.linear is kernels.gemv.linear
    torch.testing.assert_close(kernels.gemv.linear(x, w, b), torch.nn.functional.linear(x, w, b))
    out = torch.empty(m, n)
    kernels.gemv.linear(x, w, b, out=out)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, w, b))


@pytest.mark.parametrize("m,n,k,residual,bias", [(1, 24, 40, True, False), (3, 37, 64, True, True),
                                                 (2, 16, 48, False, False),
                                                 (2, 24, 100, True, False)])
def test_skinny_norm_linear(kernels, m, n, k, residual, bias):
    """Residual add + RMSNorm folded into the projection: same output and new residual as
    the separate ops (rounding included), and the residual is the input when there is none."""
    g = torch.Generator().manual_seed(m * 10 + k)
    x = torch.randn(m, k, generator=g)
    res = torch.randn(m, k, generator=g) if residual else None
    nw, w = torch.randn(k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    gemv = kernels.gemv
    # One K chunk; several (an unrolled loop); more than MAX_UNROLL (a loop), for k=100.
    for cfg in (None, (4, 8, 16, 4)):
        y, new_res = gemv.skinny_norm_linear(x, res, nw, 1e-6, w, b, config=cfg)
        ref_y, ref_res = gemv.skinny_norm_linear_ref(x, res, nw, 1e-6, w, b)
        torch.testing.assert_close(new_res, ref_res, rtol=0, atol=0)
        torch.testing.assert_close(y, ref_y, rtol=1e-5, atol=1e-4)
        if res is None:
            assert new_res is x
    # The layers' op: off CUDA it is the separate fused_add_rmsnorm + F.linear.
    y, new_res = kernels.fused.norm_linear(x, res, nw, 1e-6, w, b)
    torch.testing.assert_close(y, ref_y, rtol=1e-5, atol=1e-4)


def test_skinny_silu_linear(kernels):
    g = torch.Generator().manual_seed(8)
    gate_up, w = torch.randn(3, 2 * 40, generator=g), torch.randn(24, 40, generator=g)
    ref = kernels.gemv.skinny_silu_linear_ref(gate_up, w)
    for cfg in (None, (4, 8, 16, 4), (4, 8, 8, 4)):  # 1, 3 (unrolled) and 5 (loop) chunks
        torch.testing.assert_close(kernels.gemv.skinny_silu_linear(gate_up, w, config=cfg), ref,
                                   rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(kernels.fused.silu_linear(gate_up, w), ref, rtol=1e-5, atol=1e-4)


def test_chain_bench_options_compute_the_same_chain(kernels):
    """``bench.chain`` (a GPU benchmark) wires each projection's options into one layer
    chain; here, interpreted, a skinny tile for each projection gives the unfused path's
    result, so the options it times all compute the real chain."""
    from replaylm.bench import chain

    ps = [chain.Projection("qkv", "norm", 48, 16), chain.Projection("o_proj", "plain", 16, 32),
          chain.Projection("gate_up", "norm", 40, 16), chain.Projection("down", "silu", 16, 20)]
    c = chain.LayerChain(ps, layers=2, dtype=torch.float32, device=torch.device("cpu"))
    want_h, want_res = c.run([None] * 4)
    for slot, p in enumerate(ps):
        opts = [None] * 4
        opts[slot] = chain.options_of(p)[1]  # the first skinny tile
        h, res = c.run(opts)
        torch.testing.assert_close(h, want_h, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(res, want_res, rtol=1e-4, atol=1e-5)


def test_silu_and_mul(kernels):
    gate_up = torch.randn(3, 2 * 40, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(kernels.fused.silu_and_mul(gate_up),
                               kernels.fused.silu_and_mul_ref(gate_up))


def _rope_table(max_pos: int, d: int) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(max_pos).float(), inv)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


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
    cos_sin = _rope_table(32, d)
    kw = {}
    if qk_norm:
        kw.update(q_norm_weight=torch.randn(d, generator=g), k_norm_weight=torch.randn(d, generator=g),
                  eps=1e-6)
    caches = [torch.zeros(3, BLOCK_SIZE, hkv, d) for _ in range(4)]
    # Distinct cache slots, one token without a slot (-1).
    slots = torch.randperm(3 * BLOCK_SIZE, generator=g)[:t]
    slots[3] = -1
    out = kernels.fused.rotary(q, k, positions, cos_sin, **kw,
                               **(dict(v=v, k_cache=caches[0], v_cache=caches[1],
                                       slot_mapping=slots) if write else {}))
    ref = kernels.fused.rotary_ref(q, k, positions, cos_sin, **kw,
                                   **(dict(v=v, k_cache=caches[2], v_cache=caches[3],
                                           slot_mapping=slots) if write else {}))
    torch.testing.assert_close(out[0], ref[0])
    torch.testing.assert_close(out[1], ref[1])
    if write:
        torch.testing.assert_close(caches[0], caches[2])
        torch.testing.assert_close(caches[1], caches[3])
        written = slots[slots >= 0]
        assert (caches[0].view(-1, hkv, d)[written].abs().sum(-1) > 0).all()


@pytest.mark.parametrize("m,qk_norm,bias,bn", [(1, True, False, 4), (3, True, True, 8),
                                                (2, False, False, 16)])
def test_skinny_norm_linear_rope(kernels, m, qk_norm, bias, bn):
    """The qkv projection that does the rotary kernel's work in its own launch equals the
    projection followed by the rotary kernel (rotated q, k and v in the cache), including a
    row without a slot; run twice, as the per-head arrival counts must be back at zero."""
    g = torch.Generator().manual_seed(m * 7 + bn)
    hq, hkv, d, hidden = 4, 2, 16, 48
    x, res = torch.randn(m, hidden, generator=g), torch.randn(m, hidden, generator=g)
    nw = torch.randn(hidden, generator=g)
    w = torch.randn((hq + 2 * hkv) * d, hidden, generator=g) / hidden**0.5
    b = torch.randn(w.shape[0], generator=g) if bias else None
    positions = torch.tensor([3, 30, 17][:m])
    slots = torch.tensor([5, -1, 40][:m])
    norms = (dict(q_norm_weight=torch.randn(d, generator=g),
                  k_norm_weight=torch.randn(d, generator=g)) if qk_norm else {})
    cos_sin = _rope_table(32, d)
    caches = [torch.zeros(3, BLOCK_SIZE, hkv, d) for _ in range(4)]
    gemv = kernels.gemv
    rope = gemv.QkvRope(num_heads=hq, num_kv_heads=hkv, head_dim=d, positions=positions,
                        cos_sin=cos_sin, k_cache=caches[0], v_cache=caches[1],
                        slot_mapping=slots, eps=1e-6, **norms)
    assert gemv.rope_fits(rope, (4, bn, 16, 4)) and not gemv.rope_fits(rope, (4, 32, 16, 4))
    qkv_ref, res_ref = gemv.skinny_norm_linear_ref(x, res, nw, 1e-6, w, b)
    q_ref, _ = kernels.fused.rotary_ref(
        qkv_ref[:, :hq * d].view(m, hq, d), qkv_ref[:, hq * d:(hq + hkv) * d].view(m, hkv, d),
        positions, cos_sin, eps=1e-6, v=qkv_ref[:, (hq + hkv) * d:].view(m, hkv, d),
        k_cache=caches[2], v_cache=caches[3], slot_mapping=slots, **norms)
    for _ in range(2):
        q, new_res = gemv.skinny_norm_linear_rope(x, res, nw, 1e-6, w, b, (4, bn, 16, 4), rope)
        torch.testing.assert_close(new_res, res_ref, rtol=0, atol=0)
        torch.testing.assert_close(q, q_ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(caches[0], caches[2], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(caches[1], caches[3], rtol=1e-4, atol=1e-4)
        assert kernels.gemv._head_counters(x.device).eq(0).all()
    assert caches[0].view(-1, hkv, d)[slots[slots >= 0]].abs().sum(-1).gt(0).all()
    # The layers' op: off CUDA it is norm_linear, then the rotary kernel.
    for c in caches[:2]:
        c.zero_()
    q, _ = kernels.fused.norm_linear_rope(x, res, nw, 1e-6, w, b, rope)
    torch.testing.assert_close(q, q_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(caches[0], caches[2], rtol=1e-4, atol=1e-4)


def test_tuning_digest_follows_kernels_not_host_code(kernels, monkeypatch):
    """The disk cache of projection timings is keyed by a digest of the kernel sources and
    tile candidates: a new candidate changes it, the host code around it does not count."""
    gemv = kernels.gemv
    gemv._kernels_revision.cache_clear()
    first = gemv._kernels_revision()
    gemv._kernels_revision.cache_clear()
    assert gemv._kernels_revision() == first and len(first) == 12
    monkeypatch.setitem(gemv.CANDIDATES, 1, gemv.CANDIDATES[1] + [(32, 128, 4)])
    gemv._kernels_revision.cache_clear()
    second = gemv._kernels_revision()
    assert second != first
    monkeypatch.setattr(gemv, "TIE", gemv.TIE + 0.01)  # the tie rule decides too
    gemv._kernels_revision.cache_clear()
    assert gemv._kernels_revision() not in (first, second)
    gemv._kernels_revision.cache_clear()


def test_tuner_prefers_fewer_warps_on_near_ties(kernels, monkeypatch):
    """``_tune`` keeps the fastest tile unless a tile with fewer warps is within ``TIE`` of
    it, and the unfused path unless some tile beats it."""
    gemv = kernels.gemv
    monkeypatch.setattr(gemv, "candidate_configs", lambda m, k: [
        (1, 8, 1024, 8), (1, 4, 1024, 4), (1, 4, 512, 4), (1, 2, 1024, 2)])

    def run(times, baseline):
        def timer(fn, weights):
            return fn(weights[0])
        monkeypatch.setattr(gemv, "graph_time_us", timer)
        return gemv._tune(("plain", 1, 64, 1024), [None], lambda w: baseline,
                          lambda cfg, w: times[cfg])

    t = {(1, 8, 1024, 8): 2.17, (1, 4, 1024, 4): 2.20, (1, 4, 512, 4): 2.19, (1, 2, 1024, 2): 2.5}
    assert run(t, 9.0) == ((1, 4, 512, 4), 2.19, 9.0)  # 4 warps within 2%: the faster of them
    t[(1, 2, 1024, 2)] = 2.21
    assert run(t, 9.0)[0] == (1, 2, 1024, 2)
    t = {(1, 8, 1024, 8): 2.0, (1, 4, 1024, 4): 2.2, (1, 4, 512, 4): 2.3, (1, 2, 1024, 2): 2.5}
    assert run(t, 9.0)[0] == (1, 8, 1024, 8)  # no near tie: the fastest
    assert run(t, 2.0) == (None, 2.0, 2.0)  # nothing beats the unfused path


def test_rotary_launch_shape_overrides(kernels):
    """The rotary launch shape can be set (for latency sweeps): any power-of-two head group
    and warp count gives the same result, a partly masked last group included."""
    g = torch.Generator().manual_seed(9)
    t, hq, hkv, d = 3, 6, 2, 32
    q, k = torch.randn(t, hq, d, generator=g), torch.randn(t, hkv, d, generator=g)
    positions = torch.tensor([0, 5, 31])
    cos_sin = _rope_table(32, d)
    ref = kernels.fused.rotary_ref(q, k, positions, cos_sin)
    for hp, warps in ((1, 1), (2, 2), (4, 1), (8, 4)):
        out = kernels.fused.rotary(q, k, positions, cos_sin, heads_per_program=hp,
                                   num_warps=warps)
        torch.testing.assert_close(out[0], ref[0])
        torch.testing.assert_close(out[1], ref[1])
    with pytest.raises(AssertionError, match="power of two"):
        kernels.fused.rotary(q, k, positions, cos_sin, heads_per_program=3)


@pytest.mark.parametrize("vocab", [1000, 3 * 4096 + 5])
def test_argmax(kernels, vocab):
    """One-launch row argmax = torch.argmax: first index on ties (many per row, across
    chunks), NaN wins, an all -inf row gives 0; counters are reset for the next launch."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.randint(0, 30, (5, vocab), generator=g).float()
    x[1, vocab - 3] = 31.0  # the maximum in the last (partial) chunk
    x[2, 7] = float("nan")
    x[2, vocab - 1] = float("nan")
    x[3] = float("-inf")
    for _ in range(2):
        got = kernels.argmax.argmax(x)
        assert got.dtype == torch.int64
        assert torch.equal(got, x.argmax(-1)), (got, x.argmax(-1))
        assert not kernels.argmax._counters(x.device).any()


@pytest.mark.parametrize("vocab", [1000, 3 * 4096 + 5])
def test_argmax_into_slots(kernels, vocab):
    """The answers also land in ``dest[slots]`` (the runtime's last_token), as index_copy_
    would put them; other entries of ``dest`` are left alone."""
    g = torch.Generator().manual_seed(vocab + 1)
    x = torch.randn(3, vocab, generator=g)
    dest = torch.full((8,), -7, dtype=torch.int64)
    slots = torch.tensor([6, 1, 4])
    got = kernels.argmax.argmax(x, dest, slots)
    want = x.argmax(-1)
    assert torch.equal(got, want)
    expect = torch.full((8,), -7, dtype=torch.int64)
    expect[slots] = want
    assert torch.equal(dest, expect)
    assert not kernels.argmax._counters(x.device).any()


@pytest.mark.parametrize("num_tokens,num_reqs,max_blocks", [(1, 1, 5), (5, 3, 37), (4, 0, 3)])
def test_gather_step_inputs(kernels, num_tokens, num_reqs, max_blocks):
    """One launch = the torch path: ids gathered from last_token ++ host ids, block-table
    rows from their slots, embedding rows of the ids (an id outside the vocabulary embeds as
    zeros instead of reading past the table)."""
    g = torch.Generator().manual_seed(num_tokens * 7 + max_blocks)
    vocab, hidden, slots = 50, 24, 6
    source = torch.randint(0, vocab, (slots + num_tokens,), generator=g)
    source[slots] = vocab + 3  # an out-of-range host id (token 0 reads it below)
    gather = torch.randint(0, slots + num_tokens, (num_tokens,), generator=g)
    gather[gather == slots] = 0
    gather[0] = slots
    tables = torch.randint(0, 1000, (slots, max_blocks), generator=g, dtype=torch.int32)
    req_slots = torch.randperm(slots, generator=g)[:num_reqs]
    emb = torch.randn(vocab, hidden, generator=g)
    ids = torch.full((num_tokens,), -1, dtype=torch.int64)
    bt = torch.full((num_reqs, max_blocks), -1, dtype=torch.int32)
    out = kernels.step_inputs.gather_step_inputs(source, gather, ids, tables, req_slots, bt, emb)
    assert torch.equal(ids, source[gather])
    assert torch.equal(bt, tables[req_slots])
    assert torch.equal(out[0], torch.zeros(hidden))
    assert torch.equal(out[1:], emb[ids[1:]])


def _decode_step_both_ways(kernels, path, seed, choose):
    """A tiny model with the fused kernels: prefill 19 tokens, then run the 20th token's
    decode step twice from the same cache, after ``choose(model, False)`` and
    ``choose(model, True)``; the two steps must give the same hidden states and caches, and
    the new token's key must be in the cache. Returns the model."""
    from tests.model_helpers import bound_model, one_request_meta

    model = bound_model(path, kernels.backend, num_blocks=8)
    model.use_fused_kernels(True)
    assert model.layers[0].kernels is kernels.fused
    ids = torch.randint(3, 256, (20,), generator=torch.Generator().manual_seed(seed))
    results = []
    with torch.inference_mode():
        choose(model, True)
        model(ids[:19], torch.arange(19), one_request_meta(0, 19, [3, 5]))  # prefill
        saved = [(k.clone(), v.clone()) for k, v in model.kv_caches]
        for option in (False, True):
            for (k, v), (k0, v0) in zip(model.kv_caches, saved):
                k.copy_(k0)
                v.copy_(v0)
            meta = one_request_meta(19, 1, [3, 5])
            choose(model, option)
            hidden = model(ids[19:], torch.tensor([19]), meta)
            results.append((hidden, [(k.clone(), v.clone()) for k, v in model.kv_caches]))
    (h_off, caches_off), (h_on, caches_on) = results
    torch.testing.assert_close(h_on, h_off)
    for (k1, v1), (k2, v2) in zip(caches_on, caches_off):
        torch.testing.assert_close(k1, k2)
        torch.testing.assert_close(v1, v2)
        assert k1[5, 3].abs().sum() > 0  # the new token's key (position 19: block 5, slot 3)
    return model


def test_model_rope_in_qkv(kernels, tiny_checkpoint, monkeypatch):
    """On a decode step, the qkv projection's launch doing the rotary work gives the same
    hidden states and cache as the rotary kernel after it. Off CUDA the projection never
    picks the skinny kernel, so a tile config is forced here."""
    fused = kernels.fused
    monkeypatch.setattr(fused, "_norm_config", lambda x, *_: (
        (triton.next_power_of_2(x.shape[0]), 8, 16, 4) if x.shape[0] <= 8 else None))
    calls = []
    real = kernels.gemv.skinny_norm_linear_rope
    monkeypatch.setattr(kernels.gemv, "skinny_norm_linear_rope",
                        lambda *a: calls.append(1) or real(*a))

    def choose(model, on):
        calls.clear()
        monkeypatch.setattr(fused, "ROPE_IN_QKV", on)

    model = _decode_step_both_ways(kernels, tiny_checkpoint[1], 3, choose)
    assert len(calls) == model.cfg.num_layers  # the last (decode) step ran fused, per layer


def test_model_rope_in_attention(kernels, tiny_checkpoint):
    """On a decode step, q/k norm, rotary and the KV write inside the attention launch give
    the same hidden states and cache as the rotary kernel; a prefill step (more than one new
    token) keeps the rotary kernel, and so does a decode step of more request slots than
    the model's limit."""
    import dataclasses

    from tests.model_helpers import one_request_meta

    def choose(model, on):
        model.rope_in_attention_max_reqs = 1 if on else 0
        assert not model._defer_rope(one_request_meta(0, 19, [3, 5]))  # prefill: never
        decode = one_request_meta(19, 1, [3, 5])
        assert model._defer_rope(decode) == on
        assert not model._defer_rope(dataclasses.replace(decode, num_reqs=2))

    _decode_step_both_ways(kernels, tiny_checkpoint[1], 2, choose)
