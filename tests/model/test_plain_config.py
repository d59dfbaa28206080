"""Reading a config's fields directly (``shapes.plain_config``) gives the ``ModelConfig`` that
transformers' config classes give, and a config that leaves a field to its class's defaults
goes through the class."""

from __future__ import annotations

import json
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


def test_a_start_imports_neither_transformers_nor_dynamo():
    """Building an engine on a named shape (no tokenizer) imports no transformers model
    class and not ``torch._dynamo``: each would add seconds to every start."""
    code = ("import sys\nfrom replaylm import LLM\n"
            "LLM('default', load_format='dummy', skip_tokenizer_init=True, max_num_seqs=2, "
            "num_kv_blocks=16, max_model_len=64, max_num_batched_tokens=16)\n"
            "print(sorted(m for m in ('transformers', 'torch._dynamo') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**__import__("os").environ,
                                                       "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
