"""Reading a PEFT LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``) into
host tensors laid out as the device slots take them, checked against the base model.

The decoder fuses projections (``model.llama``): q/k/v into one qkv projection and gate/up
into one gate_up projection. Each fused projection is one *group* whose output has one
segment per piece; its adapter ``A`` stacks the pieces' ``lora_A`` along the rank dim
(``[S*r, in]``) and its ``B`` holds each piece's ``lora_B`` over that piece's output rows
(``[out, r]``). A piece the adapter does not target is zero there.

Scaling: ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora``.

Under tensor parallelism each rank keeps its shard of an adapter, split as the base weights
are (``model.parallel``):

* column-parallel qkv and gate_up: ``A`` whole (every rank sees the whole input row), ``B``
  the rows of this rank's outputs — its query heads, its KV heads (a KV head replicated
  over ranks is kept by each of them), its slice of gate and of up;
* row-parallel o_proj and down_proj: ``A`` the columns of this rank's input slice, ``B``
  whole; each rank's delta is a partial sum, completed by the all-reduce that completes the
  projection (``(Σ x_r A_r^T) B^T = Σ (x_r A_r^T) B^T``).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from replaylm.lora.request import LoRARequest
from replaylm.model.config import ModelConfig
from replaylm.model.parallel import TensorParallel

#: PEFT target module names the decoder has, each with its group and segment.
TARGETS = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2),
           "o_proj": ("o", 0), "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1),
           "down_proj": ("down", 0)}
GROUP_NAMES = ("qkv", "o", "gate_up", "down")

_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass(frozen=True)
class Group:
    """One projection of a decoder layer as LoRA sees it: input width and output segments."""

    name: str
    in_dim: int
    segments: tuple[int, ...]

    @property
    def out_dim(self) -> int:
        return sum(self.segments)


def groups(cfg: ModelConfig) -> dict[str, Group]:
    """The four LoRA groups of ``cfg``'s decoder layers (qkv, o, gate_up, down)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {
        "qkv": Group("qkv", h, (cfg.q_size, cfg.kv_size, cfg.kv_size)),
        "o": Group("o", cfg.q_size, (h,)),
        "gate_up": Group("gate_up", h, (i, i)),
        "down": Group("down", i, (h,)),
    }


@dataclass
class HostAdapter:
    """An adapter on the host: per group ``a[g]`` ``[layers, S*r, in]`` and ``b[g]``
    ``[layers, out, r]`` (model dtype; pinned on CUDA), ``ranks`` ``[groups, layers]`` (``r``
    where the layer's group has a targeted piece, else 0) and the scaling."""

    request: LoRARequest
    rank: int
    scale: float
    a: dict[str, torch.Tensor]
    b: dict[str, torch.Tensor]
    ranks: torch.Tensor

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.a.values(), *self.b.values()))


def load_adapter(request: LoRARequest, cfg: ModelConfig, max_rank: int, dtype: torch.dtype,
                 pin: bool = False, tp: TensorParallel | None = None) -> HostAdapter:
    """Read and check ``request``'s adapter against ``cfg`` (the whole model's shapes);
    ``ValueError`` naming the adapter and what is wrong: a missing file, a setting replaylm
    does not run (DoRA, biases, per-module ranks or alphas, modules_to_save), a target
    module the decoder has not, a rank above ``max_rank``, or tensors shaped for another
    base model. With ``tp``, this rank's shard (module docstring)."""
    from safetensors.torch import load_file

    name = f"LoRA adapter {request.lora_name!r} ({request.lora_path})"
    root = Path(request.lora_path)
    conf_path, weights_path = root / "adapter_config.json", root / "adapter_model.safetensors"
    if not conf_path.is_file() or not weights_path.is_file():
        raise ValueError(f"{name}: needs adapter_config.json and adapter_model.safetensors")
    conf = json.loads(conf_path.read_text())
    _check_config(conf, name)
    r = conf.get("r")
    if not isinstance(r, int) or r < 1:
        raise ValueError(f"{name}: adapter_config.json r={r!r} must be an integer >= 1")
    if r > max_rank:
        raise ValueError(f"{name}: rank {r} is above max_lora_rank={max_rank}")
    alpha = conf.get("lora_alpha", r)
    scale = alpha / math.sqrt(r) if conf.get("use_rslora", False) else alpha / r

    tensors = load_file(str(weights_path))
    gs = groups(cfg)
    layers = cfg.num_layers
    a = {g.name: torch.zeros(layers, len(g.segments) * r, g.in_dim, dtype=dtype)
         for g in gs.values()}
    b = {g.name: torch.zeros(layers, g.out_dim, r, dtype=dtype) for g in gs.values()}
    ranks = torch.zeros(len(GROUP_NAMES), layers, dtype=torch.int32)
    seen: dict[tuple[int, str], set[str]] = {}
    for key, t in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise ValueError(f"{name}: tensor {key!r} is not a LoRA weight of q/k/v/o_proj or "
                             "gate/up/down_proj (embeddings, lm_head, DoRA and "
                             "modules_to_save are not supported)")
        layer, module, which = int(m.group(1)), m.group(2), m.group(3)
        if module not in TARGETS:
            raise ValueError(f"{name}: target module {module!r} is not supported (supported: "
                             f"{', '.join(TARGETS)})")
        if layer >= layers:
            raise ValueError(f"{name}: {key!r} is for layer {layer}, but the base model has "
                             f"{layers} layers (another base model?)")
        group_name, seg = TARGETS[module]
        if group_name in ("gate_up", "down") and cfg.is_moe_layer(layer):
            raise ValueError(f"{name}: {module} of layer {layer} targets a mixture-of-experts "
                             "MLP, which LoRA does not support")
        g = gs[group_name]
        out_start = sum(g.segments[:seg])
        width = g.segments[seg]
        expected = (r, g.in_dim) if which == "A" else (width, r)
        if tuple(t.shape) != expected:
            raise ValueError(f"{name}: {key!r} has shape {list(t.shape)}, expected "
                             f"{list(expected)} for rank {r} on this base model (an adapter "
                             "for another base model?)")
        if which == "A":
            a[group_name][layer, seg * r:(seg + 1) * r] = t.to(dtype)
        else:
            b[group_name][layer, out_start:out_start + width] = t.to(dtype)
        seen.setdefault((layer, module), set()).add(which)
        ranks[GROUP_NAMES.index(group_name), layer] = r
    for (layer, module), parts in seen.items():
        if parts != {"A", "B"}:
            raise ValueError(f"{name}: layer {layer} {module} has lora_{''.join(parts)} "
                             "without its pair")
    if not seen:
        raise ValueError(f"{name}: adapter_model.safetensors holds no LoRA weights")
    if tp is not None and tp.size > 1:
        a, b = _shard(a, b, cfg, tp)
    if pin:
        a = {k: v.pin_memory() for k, v in a.items()}
        b = {k: v.pin_memory() for k, v in b.items()}
    return HostAdapter(request, r, float(scale), a, b, ranks)


def _shard(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], cfg: ModelConfig,
           tp: TensorParallel) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """This rank's shard of a whole adapter's group tensors (module docstring)."""
    size, rank = tp.size, tp.rank
    q_local = cfg.q_size // size
    kv_local = max(1, cfg.num_kv_heads // size) * cfg.head_dim
    kv_start = tp.kv_head_start() * cfg.head_dim
    i_local = cfg.intermediate_size // size
    q, kv, i = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    rows = {"qkv": [(rank * q_local, q_local), (q + kv_start, kv_local),
                    (q + kv + kv_start, kv_local)],
            "gate_up": [(rank * i_local, i_local), (i + rank * i_local, i_local)]}
    b = dict(b)
    for name, parts in rows.items():
        b[name] = torch.cat([b[name][:, start:start + width] for start, width in parts],
                            dim=1).contiguous()
    a = dict(a)
    a["o"] = a["o"][:, :, rank * q_local:(rank + 1) * q_local].contiguous()
    a["down"] = a["down"][:, :, rank * i_local:(rank + 1) * i_local].contiguous()
    return a, b


def _check_config(conf: dict, name: str) -> None:
    """Settings of ``adapter_config.json`` this implementation does not run."""
    if conf.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{name}: peft_type {conf.get('peft_type')!r} is not LORA")
    if conf.get("use_dora"):
        raise ValueError(f"{name}: DoRA (use_dora) is not supported")
    if conf.get("bias", "none") != "none":
        raise ValueError(f"{name}: bias={conf.get('bias')!r} is not supported (only 'none')")
    for key in ("rank_pattern", "alpha_pattern"):
        if conf.get(key):
            raise ValueError(f"{name}: {key} (per-module ranks or alphas) is not supported")
    if conf.get("modules_to_save"):
        raise ValueError(f"{name}: modules_to_save is not supported")
    targets = conf.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(set(targets) - set(TARGETS))
        if unknown:
            raise ValueError(f"{name}: target modules {unknown} are not supported (supported: "
                             f"{', '.join(TARGETS)})")
