"""Biased projections (Llama attention_bias + mlp_bias) through the fused Triton kernels on
the GPU: o_proj and gate_up take their bias in the skinny kernel or cuBLAS, down_proj runs
SiLU·mul and a biased projection apart. bf16 logits within tolerance of transformers', and the
engine (graphs, fused kernels) generates."""

from __future__ import annotations

import pytest
import torch

from replaylm import LLM, SamplingParams
from replaylm.engine.runner_setup import make_attention_backend
from tests.conftest import make_checkpoint
from tests.model_helpers import bound_model, decode_step, one_request_meta

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DEV = torch.device("cuda")


@pytest.fixture(scope="module")
def biased(tmp_path_factory):
    path = tmp_path_factory.mktemp("biased-llama-gpu")
    make_checkpoint("llama", path, seed=7, attention_bias=True, mlp_bias=True)
    return path


@torch.no_grad()
def test_fused_kernels_with_biases_close_to_transformers(biased):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(biased), dtype=torch.bfloat16,
                                               attn_implementation="sdpa").to(DEV).eval()
    model = bound_model(biased, make_attention_backend("triton", DEV, "eager"), torch.bfloat16, DEV)
    model.use_fused_kernels(True)
    blocks = [3, 7, 1, 9]
    prompt = torch.randint(3, 256, (21,), generator=torch.Generator().manual_seed(1))
    seq = prompt.tolist()
    ours = model.compute_logits(model(prompt.to(DEV), torch.arange(21, device=DEV),
                                      one_request_meta(0, 21, blocks, DEV)))
    theirs = ref(prompt[None].to(DEV)).logits[0].float()
    assert (ours - theirs).abs().max() < 0.03 * theirs.abs().max() + 0.02
    for _ in range(8):  # decode steps: the few-row skinny paths
        ours = decode_step(model, seq, int(theirs[-1].argmax()), blocks, DEV)
        theirs = ref(torch.tensor(seq, device=DEV)[None]).logits[0, -1:].float()
        assert (ours - theirs).abs().max() < 0.03 * theirs.abs().max() + 0.02


def test_engine_with_graphs_and_biases_generates(biased):
    llm = LLM(str(biased), num_kv_blocks=64, max_model_len=128, skip_tokenizer_init=True,
              max_num_seqs=4, max_graph_tokens=16)
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([[5, 6, 7], [9, 10, 11, 12]], sp, use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
