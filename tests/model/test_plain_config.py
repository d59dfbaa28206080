"""Reading a config's fields directly (``shapes.plain_config``) gives the ``ModelConfig`` that
transformers' config classes give, and a config that leaves a field to its class's defaults
goes through the class."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from replaylm.engine.loading import load_model_config
from replaylm.model.config import ModelConfig
from replaylm.model.shapes import (
    DEFAULT_MODEL_DIR,
    NAMED_SHAPES,
    PLAIN_ALIASES,
    PLAIN_FIELDS_BY_ARCH,
    hf_config_from_dict,
    plain_config,
)
from tests.conftest import TINY, make_checkpoint

ROOT = Path(__file__).resolve().parents[2]


def _through_transformers(path: Path, name: str | None = None) -> ModelConfig:
    from transformers import AutoConfig

    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(str(path)), name or str(path))
    eos = json.loads((path / "generation_config.json").read_text()).get("eos_token_id") \
        if (path / "generation_config.json").is_file() else None
    if eos is not None:
        import dataclasses

        ids = tuple(eos) if isinstance(eos, list) else (eos,)
        cfg = dataclasses.replace(cfg, eos_token_ids=tuple(dict.fromkeys(ids + cfg.eos_token_ids)))
    return cfg


@pytest.mark.parametrize("name", sorted(NAMED_SHAPES))
def test_named_shapes_are_read_directly_and_agree_with_transformers(name):
    shape = NAMED_SHAPES[name]
    plain = plain_config(shape)
    assert plain is not None, "a named shape names every field"
    assert ModelConfig.from_hf(plain, name) == ModelConfig.from_hf(hf_config_from_dict(shape),
                                                                   name)


@pytest.mark.parametrize("kind", sorted(TINY))
def test_saved_checkpoints_are_read_directly_and_agree_with_transformers(kind, tmp_path):
    make_checkpoint(kind, tmp_path)
    assert plain_config(json.loads((tmp_path / "config.json").read_text())) is not None
    assert load_model_config(str(tmp_path))[0] == _through_transformers(tmp_path)


def test_the_built_in_default_model_is_read_directly():
    path = Path(DEFAULT_MODEL_DIR)
    assert plain_config(json.loads((path / "config.json").read_text())) is not None
    assert load_model_config("default")[0] == _through_transformers(path, "default")


@pytest.mark.parametrize("kind,field", [("llama", "eos_token_id"), ("llama", "rms_norm_eps"),
                                        ("qwen3", "head_dim"),
                                        ("qwen2_moe", "shared_expert_intermediate_size")])
def test_a_config_that_leaves_a_field_to_its_class_goes_through_transformers(kind, field,
                                                                             tmp_path):
    """The class's default fills the field (e.g. Qwen3's head_dim of 128, not
    hidden_size / heads)."""
    make_checkpoint(kind, tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    del raw[field]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert plain_config(raw) is None
    assert load_model_config(str(tmp_path))[0] == _through_transformers(tmp_path)


def test_the_field_tables_name_supported_architectures_and_transformers_aliases():
    import transformers

    from replaylm.model.config import SUPPORTED_ARCHITECTURES

    assert set(PLAIN_FIELDS_BY_ARCH) <= set(SUPPORTED_ARCHITECTURES)
    for arch in SUPPORTED_ARCHITECTURES:
        cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
        assert PLAIN_ALIASES.get(arch, {}) == dict(cls.attribute_map), arch


def test_a_start_imports_neither_transformers_model_classes_nor_dynamo():
    """An engine on a named shape (no tokenizer) imports no transformers at all, and one with
    the built-in model's tokenizer no transformers model class; neither imports
    ``torch._dynamo``: each would add seconds to every start."""
    code = ("import sys\nfrom replaylm import LLM\n"
            "kw = dict(load_format='dummy', max_num_seqs=2, num_kv_blocks=16, max_model_len=64, "
            "max_num_batched_tokens=16)\n"
            "LLM('default', skip_tokenizer_init=True, **kw)\n"
            "print(sorted(m for m in ('transformers', 'torch._dynamo') if m in sys.modules))\n"
            "LLM('default', **kw)\n"
            "print(sorted(m for m in ('torch._dynamo', 'transformers.models.auto.modeling_auto', "
            "'transformers.generation.utils') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-2:] == ["[]", "[]"]


def test_a_generic_fast_tokenizer_is_what_auto_tokenizer_builds(tmp_path):
    """The built-in model's tokenizer_config.json names the generic fast tokenizer: loading
    that class directly gives AutoTokenizer's tokenizer; another class goes through
    AutoTokenizer."""
    import shutil

    from transformers import AutoTokenizer

    from replaylm.config import EngineArgs
    from replaylm.engine.loading import GENERIC_TOKENIZER_CLASSES, load_tokenizer

    path = Path(DEFAULT_MODEL_DIR)
    config = json.loads((path / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] in GENERIC_TOKENIZER_CLASSES
    direct = load_tokenizer(EngineArgs(model="default"), path)
    auto = AutoTokenizer.from_pretrained(str(path))
    assert type(direct) is type(auto)
    for text in ("Hello world", " leading space", "two\nlines  and  gaps", "中文 ü"):
        assert direct.encode(text) == auto.encode(text)
        assert direct.decode(auto.encode(text)) == auto.decode(auto.encode(text))
    assert direct.all_special_ids == auto.all_special_ids
    assert direct.chat_template == auto.chat_template
    other = tmp_path / "tok"
    shutil.copytree(path, other, ignore=shutil.ignore_patterns("*.safetensors"))
    (other / "tokenizer_config.json").write_text(
        json.dumps(config | {"tokenizer_class": "LlamaTokenizerFast"}))
    loaded = load_tokenizer(EngineArgs(model=str(other)), other)
    assert type(loaded) is type(AutoTokenizer.from_pretrained(str(other)))
