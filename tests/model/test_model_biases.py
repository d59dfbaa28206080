"""Checkpoints with biased projections load every bias and match transformers: Llama's
``attention_bias`` (q, k, v and o_proj) and ``mlp_bias`` (gate, up, down), Qwen3's
``attention_bias``. A tensor the model has no place for is refused, never dropped."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from replaylm import LLM, SamplingParams
from replaylm.attention.torch_ref import TorchAttentionBackend
from replaylm.engine.loading import load_model_config
from tests.conftest import make_checkpoint
from tests.model_helpers import bound_model, decode_step, one_request_meta

CASES = {
    "llama-attention_bias": ("llama", {"attention_bias": True}),
    "llama-mlp_bias": ("llama", {"mlp_bias": True}),
    "llama-both": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "qwen3-attention_bias": ("qwen3", {"attention_bias": True}),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def biased(request, tmp_path_factory):
    kind, flags = CASES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    ref = make_checkpoint(kind, path, seed=7, **flags)
    names = set(load_file(str(path / "model.safetensors")))
    assert any(n.endswith(("o_proj.bias", "down_proj.bias")) for n in names)  # really biased
    return request.param, path, ref


@torch.no_grad()
def test_logits_match_transformers(biased):
    name, path, ref = biased
    cfg, _ = load_model_config(str(path))
    flags = CASES[name][1]
    assert cfg.o_bias == flags.get("attention_bias", False)
    assert cfg.mlp_bias == flags.get("mlp_bias", False)
    model = bound_model(path, TorchAttentionBackend())
    n_ours = sum(p.numel() for p in model.parameters())
    assert n_ours == sum(p.numel() for p in ref.parameters()) == cfg.num_params
    prompt = torch.randint(3, 256, (23,), generator=torch.Generator().manual_seed(3))
    blocks = [2, 5, 1]
    ours = model.compute_logits(model(prompt, torch.arange(23), one_request_meta(0, 23, blocks)))
    theirs = ref(prompt[None]).logits[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    seq = prompt.tolist()
    for _ in range(4):
        ours = decode_step(model, seq, int(ours[-1].argmax()), blocks)
        theirs = ref(torch.tensor(seq)[None]).logits[0, -1:]
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_engine_greedy_matches_transformers(biased):
    _, path, ref = biased
    prompt = torch.randint(3, 256, (9,), generator=torch.Generator().manual_seed(5)).tolist()
    want = ref.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8,
                        do_sample=False, pad_token_id=0, eos_token_id=None)[0, 9:].tolist()
    llm = LLM(str(path), num_kv_blocks=16, max_model_len=64, skip_tokenizer_init=True)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == want


def test_a_tensor_without_a_place_is_refused(tmp_path):
    make_checkpoint("qwen2", tmp_path, seed=1)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)  # Qwen2 has none
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.o_proj\.bias has no place"):
        LLM(str(tmp_path), num_kv_blocks=8, skip_tokenizer_init=True)
