"""Named model shapes: the public HF configs of the benchmark models, so runs need no checkpoint.

A named shape plus ``load_format="dummy"`` gives a model with random weights of exactly the
size and layout of the real one; decode speed does not depend on weight values.
"""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PretrainedConfig

DEFAULT_MODEL_DIR: str = str(Path(__file__).resolve().parent.parent / "assets" / "default")

NAMED_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_act": "silu",
        "attention_bias": False,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "tie_word_embeddings": True,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "torch_dtype": "bfloat16",
    },
    "llama3.2-1b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "tie_word_embeddings": True,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "torch_dtype": "bfloat16",
    },
    "llama3-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "torch_dtype": "bfloat16",
    },
    # Qwen1.5-MoE-A2.7B: 60 routed experts (top 4, not renormalised) + a shared expert.
    "qwen1.5-moe-a2.7b": {
        "architectures": ["Qwen2MoeForCausalLM"],
        "model_type": "qwen2_moe",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "hidden_act": "silu",
        "qkv_bias": True,
        "use_sliding_window": False,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
        "torch_dtype": "bfloat16",
    },
    # Qwen3-30B-A3B: 128 routed experts (top 8, renormalised), no shared expert, q/k norm.
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "hidden_act": "silu",
        "attention_bias": False,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "torch_dtype": "bfloat16",
    },
}


def resolve_model(name_or_dir: str) -> tuple[str | None, dict[str, Any] | None]:
    """Map ``--model`` to ``(directory, None)`` or ``(None, config_dict)``.

    An existing directory wins over a shape of the same name, so a local checkpoint called
    ``llama3-8b`` is never silently replaced by random weights. ``"default"`` is the built-in
    tiny model shipped in ``assets/default``. The returned dict is a copy the caller may mutate.
    """
    if Path(name_or_dir).is_dir():
        return str(Path(name_or_dir)), None
    if name_or_dir == "default":
        return DEFAULT_MODEL_DIR, None
    key = name_or_dir.lower()
    if key in NAMED_SHAPES:
        return None, copy.deepcopy(NAMED_SHAPES[key])
    names = ", ".join(["default", *NAMED_SHAPES])
    raise FileNotFoundError(
        f"model {name_or_dir!r} is neither an existing directory nor a named shape "
        f"(named shapes: {names})"
    )


#: The fields ``ModelConfig.from_hf`` needs from every config, and from some architectures'
#: configs: those whose transformers class default differs from the one ``from_hf`` assumes
#: for an absent field, or that it reads without one. ``save_pretrained`` writes them all.
PLAIN_FIELDS = ("architectures", "vocab_size", "hidden_size", "intermediate_size",
                "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
                "bos_token_id", "eos_token_id")
PLAIN_FIELDS_BY_ARCH = {
    "Qwen3ForCausalLM": ("head_dim",),
    "Qwen3MoeForCausalLM": ("head_dim", "num_experts", "num_experts_per_tok", "norm_topk_prob",
                            "moe_intermediate_size", "decoder_sparse_step", "mlp_only_layers"),
    "Qwen2MoeForCausalLM": ("num_experts", "num_experts_per_tok", "norm_topk_prob",
                            "moe_intermediate_size", "shared_expert_intermediate_size",
                            "decoder_sparse_step", "mlp_only_layers", "qkv_bias"),
}
#: Fields a transformers config class stores under another name (its ``attribute_map``).
PLAIN_ALIASES = {"Qwen3MoeForCausalLM": {"num_experts": "num_local_experts"}}


def _fold_rope(d: dict[str, Any]) -> dict[str, Any]:
    """``d`` without ``model_type``, its RoPE settings in ``rope_parameters``.

    transformers 5 keeps RoPE settings in ``rope_parameters`` (``rope_theta`` included);
    the legacy ``rope_scaling`` key is folded into it here so the result does not depend
    on how a given transformers version converts old-style configs."""
    rest = {k: v for k, v in d.items() if k != "model_type"}
    scaling = rest.pop("rope_scaling", None)
    if "rope_parameters" not in rest:
        params: dict[str, Any] = {"rope_type": "default"}
        if scaling:
            params = dict(scaling)
            # Older configs spell the key "type".
            params.setdefault("rope_type", params.pop("type", "default"))
        if "rope_theta" in rest:
            params["rope_theta"] = rest["rope_theta"]
        rest["rope_parameters"] = params
    dtype = rest.pop("torch_dtype", None)
    if dtype is not None:
        rest.setdefault("dtype", dtype)
    return rest


def hf_config_from_dict(d: dict[str, Any]) -> PretrainedConfig:
    """Build the transformers config class for ``d["model_type"]`` from a config dict (RoPE
    settings folded into ``rope_parameters`` first)."""
    from transformers import AutoConfig

    return AutoConfig.for_model(d["model_type"], **_fold_rope(d))


def plain_config(d: dict[str, Any]) -> SimpleNamespace | None:
    """A config dict's fields as attributes (RoPE folded as ``hf_config_from_dict`` folds
    it), for ``ModelConfig.from_hf``, when the dict names every field ``from_hf`` needs
    (``PLAIN_FIELDS``, ``PLAIN_FIELDS_BY_ARCH``); None when it leaves one to its
    transformers class's defaults.

    Reading the fields directly spares a start the import of transformers' model classes:
    building one of its config classes imports its modeling and generation modules and with
    them ``torch._dynamo`` (seconds of a start, more without bytecode caches)."""
    archs = d.get("architectures") or ()
    d = dict(d)
    for arch in archs:
        for name, stored in PLAIN_ALIASES.get(arch, {}).items():
            if name not in d and stored in d:
                d[name] = d[stored]
    needed = PLAIN_FIELDS + tuple(f for a in archs for f in PLAIN_FIELDS_BY_ARCH.get(a, ()))
    if any(f not in d for f in needed):
        return None
    return SimpleNamespace(model_type=d.get("model_type"), **_fold_rope(d))


def hf_fields(d: dict[str, Any]) -> Any:
    """What ``ModelConfig.from_hf`` reads a config dict through: ``plain_config`` where the
    dict is complete, else its transformers class."""
    plain = plain_config(d)
    return plain if plain is not None else hf_config_from_dict(d)
