"""fp32 means fp32 on the GPU: the Triton kernels that multiply matrices (paged attention, the
grouped MoE experts) give float32 results as close to a float64 reference as float32 rounding
allows (a relative error near 1e-6; TF32 products would leave ~1e-3), torch's matmuls are
left without TF32, and every tiny checkpoint, MoE kinds included, follows transformers in
float32 on the GPU.

Run with ``pytest -m gpu tests/gpu/test_fp32_gpu.py``; skipped without CUDA/Triton.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

from tests.gpu.requires import compiled_triton  # noqa: E402

triton = compiled_triton()

from replaylm import LLM, SamplingParams  # noqa: E402
from replaylm.attention.torch_ref import gather_kv  # noqa: E402
from replaylm.engine.runner_setup import make_attention_backend  # noqa: E402
from replaylm.kernels import attention as attn  # noqa: E402
from replaylm.kernels import moe, moe_decode, ref  # noqa: E402
from tests import attn_helpers  # noqa: E402
from tests.model_helpers import bound_model, one_request_meta  # noqa: E402

DEV = torch.device("cuda")
#: Relative (Frobenius-norm) error a float32 kernel may show against float64.
REL = 1e-5


def rel_err(got: torch.Tensor, exact: torch.Tensor) -> float:
    return float((got.double() - exact).norm() / exact.norm())


def attention_f64(q, k_cache, v_cache, cu, kv_lens, block_table, scale):
    """Causal paged attention in float64, one request at a time."""
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    group = q.shape[1] // k_cache.shape[2]
    for i, kv_len in enumerate(kv_lens):
        s, e = cu[i], cu[i + 1]
        if e == s or kv_len == 0:
            continue
        k = gather_kv(k_cache, block_table[i], kv_len).double().repeat_interleave(group, dim=1)
        v = gather_kv(v_cache, block_table[i], kv_len).double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[s:e].double(), k) * scale
        q_pos = torch.arange(kv_len - (e - s), kv_len, device=q.device)
        k_pos = torch.arange(kv_len, device=q.device)
        scores.masked_fill_(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[s:e] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


@pytest.mark.parametrize("splits", [None, 8])
@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (16, 8, 64)])
def test_fp32_attention_matches_float64(splits, hq, hkv, d):
    q_lens = [300, 1, 1, 5, 64] if splits is None else [1, 1, 4]
    kv_lens = [1000, 15, 4097, 40, 64] if splits is None else [9000, 300, 2001]
    q, kc, vc, meta = attn_helpers.make_batch(q_lens, kv_lens, hq=hq, hkv=hkv, d=d,
                                              dtype=torch.float32, pad_tokens=3, pad_slots=1,
                                              device=DEV)
    q, kc, vc = q.to(DEV), kc.to(DEV), vc.to(DEV)
    scale = d ** -0.5
    out = attn.paged_attention(q, kc, vc, meta.cu_seqlens_q, meta.kv_lens, meta.block_table,
                               scale, max_q_len=meta.max_q_len, max_kv_len=meta.max_kv_len,
                               num_splits=splits)
    exact = attention_f64(q, kc, vc, meta.cu_seqlens_q_cpu, meta.kv_lens_cpu,
                          meta.block_table, scale)
    t = meta.cu_seqlens_q_cpu[-1]
    assert out.dtype == torch.float32
    assert rel_err(out[:t], exact[:t]) < REL


def _experts(t: int, seed: int):
    e, k, h, i = 16, 4, 1024, 512
    g = torch.Generator(device=DEV).manual_seed(seed)
    w_gate_up = torch.randn(e, 2 * i, h, generator=g, device=DEV) * 0.03
    w_down = torch.randn(e, h, i, generator=g, device=DEV) * 0.03
    x = torch.randn(t, h, generator=g, device=DEV)
    weights, ids = ref.route_topk(torch.randn(t, e, generator=g, device=DEV), k, normalize=True)
    exact = ref.fused_moe(x.double(), w_gate_up.double(), w_down.double(), weights.double(), ids)
    return (x, w_gate_up, w_down, weights, ids), exact


@pytest.mark.parametrize("t", [16, 100])
def test_fp32_grouped_moe_matches_float64(t):
    args, exact = _experts(t, seed=t)
    assert rel_err(moe.fused_moe(*args), exact) < REL


def test_fp32_gemv_moe_matches_float64():
    args, exact = _experts(4, seed=1)
    assert rel_err(moe_decode.gemv_moe(*args), exact) < REL


@torch.no_grad()
def test_fp32_logits_match_transformers_on_gpu(tiny_checkpoint):
    """Every tiny checkpoint (Qwen2-MoE and Qwen3-MoE among them) through the Triton kernels in
    float32: a prefill and 32 teacher-forced decode steps within 1e-4 of transformers' float32
    logits on the same GPU (a TF32 product moves a logit by more: a near tie, 0.529287 against
    0.529142, flipped Qwen3-MoE's argmax), and torch's matmuls never switched to TF32."""
    kind, path, _ = tiny_checkpoint
    from transformers import AutoModelForCausalLM

    theirs_model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                        attn_implementation="eager").to(DEV)
    model = bound_model(path, make_attention_backend("triton", DEV, "eager"), torch.float32, DEV)
    assert not torch.backends.cuda.matmul.allow_tf32
    assert torch.get_float32_matmul_precision() == "highest"
    blocks = [3, 7, 1, 9, 4, 5]
    prompt = torch.randint(3, 256, (37,), generator=torch.Generator().manual_seed(1))
    ours = model.compute_logits(model(prompt.to(DEV), torch.arange(37, device=DEV),
                                      one_request_meta(0, 37, blocks, DEV)))
    theirs = theirs_model.eval()(prompt[None].to(DEV)).logits[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4, msg=f"{kind} prefill")
    seq = prompt.tolist()
    for step in range(32):
        nxt = int(theirs[-1].argmax())
        seq.append(nxt)
        pos = len(seq) - 1
        ours = model.compute_logits(model(torch.tensor([nxt], device=DEV),
                                          torch.tensor([pos], device=DEV),
                                          one_request_meta(pos, 1, blocks, DEV)))
        theirs = theirs_model(torch.tensor(seq, device=DEV)[None]).logits[0, -1:]
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4, msg=f"{kind} step {step}")


def test_fp32_greedy_generation_matches_transformers_on_gpu(tiny_checkpoint):
    """The engine in float32 with its default graphs (the MoE kinds' grouped and GEMV expert
    kernels, attention with rotary inside) generates transformers' greedy tokens on the GPU."""
    kind, path, _ = tiny_checkpoint
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                              attn_implementation="eager").to(DEV).eval()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 17, 33, 40)]
    expected = []
    for p in prompts:
        out = hf.generate(torch.tensor([p], device=DEV), max_new_tokens=12, min_new_tokens=12,
                          do_sample=False, pad_token_id=0, eos_token_id=None)
        expected.append(out[0, len(p):].tolist())
    llm = LLM(str(path), dtype="float32", num_kv_blocks=128,
              skip_tokenizer_init=True, max_num_seqs=4)
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert got == expected, kind
    assert not torch.backends.cuda.matmul.allow_tf32
