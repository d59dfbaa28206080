"""Which weights a model holds in FP8: from ``EngineArgs.quantization`` and from a checkpoint's
``quantization_config`` (the compressed-tensors format llm-compressor writes).

A compressed-tensors FP8 checkpoint stores each quantized projection's ``weight`` as
``float8_e4m3fn`` beside its float32 ``weight_scale`` (``[N, 1]`` per channel, or one value
per tensor, which is expanded to every row). replaylm reads exactly the configuration
below and refuses anything else at start-up with a ``ValueError`` naming the field, never
reading a checkpoint it does not understand:

- ``quant_method: "compressed-tensors"``, ``format`` ``"float-quantized"`` or
  ``"naive-quantized"``;
- one config group targeting ``["Linear"]``, whose ``weights`` are ``num_bits: 8``,
  ``type: "float"``, symmetric, static, ``strategy`` ``"channel"`` or ``"tensor"`` (no
  group or block sizes);
- ``input_activations`` absent (weight-only) or ``num_bits: 8, type: "float", strategy:
  "token", dynamic: true`` (replaylm quantizes activations per token wherever it runs a
  W8A8 GEMM anyway); no ``output_activations``, KV-cache scheme, sparsity or transforms;
- ``ignore``: module names (``lm_head``, ``model.layers.0.mlp.gate``) or ``re:`` patterns
  (``re:.*mlp.gate$``) kept in the model dtype. A fused projection (q | k | v,
  gate | up, a layer's experts) is ignored whole or not at all.

The config is parsed here, not by the ``compressed-tensors`` package, so a machine that
serves such a checkpoint needs nothing beyond replaylm's own dependencies.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from replaylm.model.config import ModelConfig
from replaylm.model.quant import Fp8Scheme

FORMATS = ("float-quantized", "naive-quantized")
STRATEGIES = ("channel", "tensor")


def read_quantization_config(model_dir: Path | None) -> dict[str, Any] | None:
    """``config.json``'s ``quantization_config`` in ``model_dir``, or None."""
    if model_dir is None or not (model_dir / "config.json").is_file():
        return None
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except ValueError as e:
        raise ValueError(f"unreadable config.json in {model_dir}: {e}") from e
    qc = config.get("quantization_config") if isinstance(config, dict) else None
    return qc if qc else None


def fp8_scheme(cfg: ModelConfig, model_dir: Path | None, quantization: str | None,
               quantize_lm_head: bool) -> Fp8Scheme | None:
    """The weights to hold in FP8 (None: none). ``quantization="fp8"`` quantizes every
    projection (and with ``quantize_lm_head`` the LM head) as it loads; a compressed-tensors
    FP8 checkpoint is read as stored, its ``ignore`` list kept in the model dtype unless
    ``quantization="fp8"`` asks for every projection."""
    qc = read_quantization_config(model_dir)
    if qc is None:
        return Fp8Scheme(lm_head=quantize_lm_head) if quantization == "fp8" else None
    ignore = parse(qc)
    skip = ignored_modules(cfg, ignore)
    lm_head = "lm_head" not in skip
    if quantization == "fp8":
        return Fp8Scheme(lm_head=lm_head or quantize_lm_head, checkpoint=True)
    return Fp8Scheme(lm_head=lm_head, skip=frozenset(skip - {"lm_head"}), checkpoint=True)


def _refuse(field: str, value: Any, supported: str) -> ValueError:
    return ValueError(f"checkpoint quantization_config.{field}={value!r} is not supported: "
                      f"{supported}")


def parse(qc: dict[str, Any]) -> list[str]:
    """Check a ``quantization_config`` against what replaylm reads; returns its ``ignore``
    list. Raises ``ValueError`` naming the first unsupported field."""
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        raise _refuse("quant_method", method, "replaylm reads compressed-tensors FP8 "
                      "checkpoints (or quantizes a float checkpoint itself with "
                      "quantization='fp8')")
    fmt = qc.get("format")
    if fmt not in FORMATS:
        raise _refuse("format", fmt, f"use one of {list(FORMATS)}")
    for field in ("kv_cache_scheme", "transform_config"):
        if qc.get(field):
            raise _refuse(field, qc[field], "replaylm reads FP8 weights only")
    sparsity = qc.get("sparsity_config")
    if sparsity and sparsity.get("format", "dense") != "dense":
        raise _refuse("sparsity_config", sparsity, "dense weights only")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        raise _refuse("config_groups", groups, "exactly one config group")
    (name, group), = groups.items()
    _check_group(f"config_groups.{name}", group)
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
        raise _refuse("ignore", ignore, "a list of module names or 're:' patterns")
    return ignore


def _check_group(where: str, group: Any) -> None:
    if not isinstance(group, dict):
        raise _refuse(where, group, "a config group object")
    if group.get("targets") != ["Linear"]:
        raise _refuse(f"{where}.targets", group.get("targets"), "['Linear'] only")
    if group.get("format") not in (None, *FORMATS):
        raise _refuse(f"{where}.format", group.get("format"), f"one of {list(FORMATS)}")
    weights = group.get("weights")
    if not isinstance(weights, dict):
        raise _refuse(f"{where}.weights", weights, "FP8 weights (num_bits 8, type float)")
    expected = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                "group_size": None, "block_structure": None, "actorder": None}
    for key, value in expected.items():
        if weights.get(key, value) != value:
            raise _refuse(f"{where}.weights.{key}", weights.get(key),
                          f"replaylm reads {key}={value!r} (FP8 e4m3 weights with static "
                          "per-channel or per-tensor scales)")
    if weights.get("strategy") not in STRATEGIES:
        raise _refuse(f"{where}.weights.strategy", weights.get("strategy"),
                      f"one of {list(STRATEGIES)}")
    acts = group.get("input_activations")
    if acts is not None:
        wanted = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
        for key, value in wanted.items():
            if acts.get(key) != value:
                raise _refuse(f"{where}.input_activations.{key}", acts.get(key),
                              "input activations absent (weight-only) or FP8 dynamic per "
                              f"token ({key}={value!r})")
        if acts.get("group_size") is not None or acts.get("block_structure") is not None:
            raise _refuse(f"{where}.input_activations", acts, "dynamic per-token scales")
    if group.get("output_activations") is not None:
        raise _refuse(f"{where}.output_activations", group["output_activations"],
                      "no output activation quantization")


def _matches(name: str, ignore: list[str]) -> bool:
    for target in ignore:
        if target.startswith("re:"):
            if re.match(target[3:], name):
                return True
        elif name == target:
            return True
    return False


def checkpoint_modules(cfg: ModelConfig) -> dict[str, list[str]]:
    """Each of our FP8-capable modules (``model.quant``) and the checkpoint modules that
    make it (``layers.0.qkv_proj`` -> ``model.layers.0.self_attn.q_proj``, ``...k_proj``,
    ``...v_proj``)."""
    out: dict[str, list[str]] = {"lm_head": ["lm_head"]}
    for i in range(cfg.num_layers):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        out[f"layers.{i}.qkv_proj"] = [f"{attn}.{p}_proj" for p in "qkv"]
        out[f"layers.{i}.o_proj"] = [f"{attn}.o_proj"]
        if not cfg.is_moe_layer(i):
            out[f"layers.{i}.gate_up_proj"] = [f"{mlp}.gate_proj", f"{mlp}.up_proj"]
            out[f"layers.{i}.down_proj"] = [f"{mlp}.down_proj"]
            continue
        experts = range(cfg.num_experts)
        out[f"layers.{i}.moe.experts_gate_up"] = [f"{mlp}.experts.{e}.{p}_proj"
                                                  for e in experts for p in ("gate", "up")]
        out[f"layers.{i}.moe.experts_down"] = [f"{mlp}.experts.{e}.down_proj" for e in experts]
        if cfg.shared_expert_intermediate_size:
            out[f"layers.{i}.moe.shared_gate_up"] = [f"{mlp}.shared_expert.gate_proj",
                                                     f"{mlp}.shared_expert.up_proj"]
            out[f"layers.{i}.moe.shared_down"] = [f"{mlp}.shared_expert.down_proj"]
    return out


def ignored_modules(cfg: ModelConfig, ignore: list[str]) -> set[str]:
    """Our modules the ``ignore`` list keeps in the model dtype; ``ValueError`` when it
    names part of a fused one only."""
    skip = set()
    for ours, theirs in checkpoint_modules(cfg).items():
        hits = [name for name in theirs if _matches(name, ignore)]
        if hits and len(hits) != len(theirs):
            raise _refuse("ignore", hits[:3], f"replaylm fuses {', '.join(theirs[:3])}"
                          f"{' ...' if len(theirs) > 3 else ''} into one projection: ignore "
                          "all of them or none")
        if hits:
            skip.add(ours)
    return skip
