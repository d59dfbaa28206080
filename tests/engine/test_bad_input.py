"""Bad input gets a clear error naming what was wrong, and nothing else is lost."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from replaylm import LLM, SamplingParams


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tests.conftest import make_checkpoint

    path = tmp_path_factory.mktemp("bad-input-qwen2")
    make_checkpoint("qwen2", path, seed=5)
    return path


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(str(ckpt), num_kv_blocks=64, max_model_len=64, skip_tokenizer_init=True)


def _copy(ckpt, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(ckpt, dst)
    return dst


def test_missing_model_names_the_path_and_shapes(tmp_path):
    with pytest.raises(FileNotFoundError, match="no-such-model") as e:
        LLM(str(tmp_path / "no-such-model"))
    assert "llama3-8b" in str(e.value)  # lists the named shapes


def test_directory_without_config(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        LLM(str(tmp_path / "empty"))


def test_missing_and_unreadable_weights(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path)
    (d / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        LLM(str(d), num_kv_blocks=8, skip_tokenizer_init=True)
    (d / "model.safetensors").write_bytes(b"this is not a safetensors file")
    with pytest.raises(ValueError, match="unreadable safetensors file"):
        LLM(str(d), num_kv_blocks=8, skip_tokenizer_init=True)


def test_unreadable_config(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path)
    (d / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(d), num_kv_blocks=8, skip_tokenizer_init=True)


def test_unsupported_architecture_is_named(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["MistralForCausalLM"]
    cfg["model_type"] = "mistral"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="MistralForCausalLM") as e:
        LLM(str(d), num_kv_blocks=8, skip_tokenizer_init=True)
    assert "Qwen3ForCausalLM" in str(e.value) and "LlamaForCausalLM" in str(e.value)


def test_wrong_tensor_shape_names_tensor_and_shapes(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path)
    tensors = load_file(str(d / "model.safetensors"))
    name = "model.layers.1.mlp.up_proj.weight"
    tensors[name] = torch.zeros(tensors[name].shape[0] + 1, tensors[name].shape[1])
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=r"up_proj.weight has shape \[97, 64\].*expects \[96, 64\]"):
        LLM(str(d), num_kv_blocks=8, skip_tokenizer_init=True)


def test_missing_tensor_is_named(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path)
    tensors = load_file(str(d / "model.safetensors"))
    del tensors["model.layers.0.self_attn.k_proj.bias"]
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing weights for: layers.0.qkv_proj.bias"):
        LLM(str(d), num_kv_blocks=8, skip_tokenizer_init=True)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-3), "top_k"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(seed=-1), "seed"),
        (dict(stop_token_ids=[-4]), "stop_token_ids"),
    ],
)
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}=.*(must|invalid)"):
        SamplingParams(**kwargs)


def test_invalid_engine_args_name_the_field():
    with pytest.raises(ValueError, match="max_num_seqs"):
        LLM("default", max_num_seqs=0)
    with pytest.raises(ValueError, match="cuda_graph_mode"):
        LLM("default", cuda_graph_mode="fastest")
    with pytest.raises(ValueError, match="dtype"):
        LLM("default", dtype="int8")
    with pytest.raises(ValueError, match=r"max_mixed_prefill_tokens=-1 .*>= 0"):
        LLM("default", max_mixed_prefill_tokens=-1)
    with pytest.raises(ValueError, match=r"gc_gen0_threshold=-5 .*>= 0"):
        LLM("default", gc_gen0_threshold=-5)


@pytest.mark.parametrize(
    "prompt, message",
    [
        ([], "prompt is empty"),
        (list(range(3, 70)), "max_model_len=64"),
        ([1, 2, 256], "outside the vocabulary"),
        ("text needs a tokenizer", "no tokenizer"),
    ],
)
def test_bad_prompt_is_rejected_and_others_keep_running(llm, prompt, message):
    core = llm.engine
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    core.add_request("good", [5, 6, 7], sp)
    out = [t for d in core.step() for t in d.new_token_ids]
    used = core.block_manager.num_used_blocks
    rejected = llm.stats().requests_rejected
    with pytest.raises(ValueError, match=message):
        core.add_request("bad", prompt, sp)
    assert core.block_manager.num_used_blocks == used  # the rejected request holds nothing
    assert llm.stats().requests_rejected == rejected + 1
    while core.has_unfinished():
        for d in core.step():
            out += d.new_token_ids
    assert len(out) == 6
    assert core.block_manager.num_used_blocks == 0


def test_generate_validates_every_prompt_first(llm):
    with pytest.raises(ValueError, match="prompt 1: prompt is empty"):
        llm.generate([[1, 2], []], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished()
    assert llm.engine.block_manager.num_used_blocks == 0
