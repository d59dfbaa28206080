"""FP8 weights: which parameters a model holds in ``float8_e4m3fn``, and their scales.

A quantized projection keeps its ``weight`` parameter (now ``float8_e4m3fn``, same shape)
and gains a ``weight_scale`` parameter: float32, one scale per output row (``[N]``; the
packed MoE experts' ``experts_gate_up_scale`` ``[E, 2I]`` and ``experts_down_scale``
``[E, H]``). The product is ``x @ (weight * weight_scale[:, None]).T`` (``kernels.ref.
linear`` with ``scale``). Scales are parameters, not buffers, so that everything that
follows parameters follows them too: sleep mode's arena, the weight map (a checkpoint's
``*.weight_scale`` tensors load by name), in-place updates.

Because a scale belongs to one output row, the fused projections (q | k | v, gate | up)
need nothing special: each shard's rows bring their own scales. Under tensor parallelism a
column-parallel rank holds its rows and their scales; a row-parallel rank (o_proj, down)
holds its columns of every row, and quantizing its slice gives scales of its own slice
(``weight_map.Placement.write``).

Quantized: the attention and MLP projections (qkv, o, gate | up, down), the routed experts
and the shared expert of MoE layers, and with ``lm_head`` the LM head (an untied one: a
tied head is the embedding, which stays in the model dtype). Never: the embedding, norms,
the MoE router and the shared expert's gate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from replaylm.kernels.ref import FP8_DTYPE
from replaylm.model.config import ModelConfig

#: Our projection modules quantized in each decoder layer (``layers.{i}.<name>``).
LAYER_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "moe.shared_gate_up",
                     "moe.shared_down")
#: The packed routed-expert parameters of an MoE layer (``layers.{i}.moe.<name>``).
EXPERT_PARAMS = ("experts_gate_up", "experts_down")
SCALE_SUFFIX = "_scale"


class Linear(nn.Linear):
    """A projection that may hold FP8 weights: ``weight_scale`` is None until
    :func:`quantize_model` makes ``weight`` FP8 and gives it its per-row scales."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.register_parameter("weight_scale", None)


@dataclass(frozen=True)
class Fp8Scheme:
    """How a model's weights are held in FP8. ``lm_head``: the (untied) LM head too.
    ``skip``: our module names (``layers.3.qkv_proj``) kept in the model dtype (a
    checkpoint's ``ignore`` list). ``checkpoint``: the checkpoint holds FP8 weights and
    their scales (compressed-tensors); otherwise its weights are quantized as they load."""

    lm_head: bool = False
    skip: frozenset[str] = frozenset()
    checkpoint: bool = False


def scale_name(pname: str) -> str:
    """The scale parameter of FP8 parameter ``pname``: ``...qkv_proj.weight`` ->
    ``...qkv_proj.weight_scale``, ``...moe.experts_down`` -> ``...moe.experts_down_scale``."""
    return pname + SCALE_SUFFIX


def is_scale(pname: str) -> bool:
    return pname.endswith(SCALE_SUFFIX)


def quantized_targets(model: nn.Module, scheme: Fp8Scheme) -> list[str]:
    """The parameter names of ``model`` (a ``CausalLM``) that ``scheme`` holds in FP8."""
    params = dict(model.named_parameters())
    names = []
    for i in range(len(model.layers)):
        for module in LAYER_PROJECTIONS:
            if f"layers.{i}.{module}.weight" in params \
                    and f"layers.{i}.{module}" not in scheme.skip:
                names.append(f"layers.{i}.{module}.weight")
        for expert in EXPERT_PARAMS:
            if f"layers.{i}.moe.{expert}" in params \
                    and f"layers.{i}.moe.{expert}" not in scheme.skip:
                names.append(f"layers.{i}.moe.{expert}")
    if scheme.lm_head and "lm_head.weight" in params:
        names.append("lm_head.weight")
    return names


def quantize_model(model: nn.Module, scheme: Fp8Scheme) -> None:
    """Make the weights ``scheme`` names FP8, with float32 ``*_scale`` parameters beside
    them (contents undefined: loading fills both, ``weight_map.Placement.write``)."""
    for pname in quantized_targets(model, scheme):
        owner_name, _, leaf = pname.rpartition(".")
        owner = model.get_submodule(owner_name)
        old = getattr(owner, leaf)
        device = old.device
        setattr(owner, leaf, nn.Parameter(torch.empty(old.shape, dtype=FP8_DTYPE, device=device),
                                          requires_grad=False))
        setattr(owner, leaf + SCALE_SUFFIX, nn.Parameter(
            torch.ones(old.shape[:-1], dtype=torch.float32, device=device),
            requires_grad=False))


def weight_bytes(cfg: ModelConfig, dtype: torch.dtype, scheme: Fp8Scheme | None,
                 active: bool = False) -> int:
    """Bytes of the model's weights held as ``scheme`` says (``cfg.weight_bytes`` without
    one): each FP8 weight one byte a parameter plus four per row for its scale, the rest in
    ``dtype``. With ``active``, those one token reads (MoE: its top-k experts)."""
    total = cfg.weight_bytes(dtype, active)
    if scheme is None:
        return total
    size = torch.empty((), dtype=dtype).element_size()
    for rows, params in _fp8_blocks(cfg, scheme, active):
        total += params * (1 - size) + rows * 4
    return total


def _fp8_blocks(cfg: ModelConfig, scheme: Fp8Scheme, active: bool) -> list[tuple[int, int]]:
    """(rows, parameters) of every weight ``scheme`` holds in FP8 (per token with
    ``active``)."""
    h, q, kv = cfg.hidden_size, cfg.q_size, cfg.kv_size
    blocks = []
    for i in range(cfg.num_layers):
        mine = {"qkv_proj": (q + 2 * kv, h), "o_proj": (h, q)}
        if cfg.is_moe_layer(i):
            e = cfg.num_experts_per_tok if active else cfg.num_experts
            mi, s = cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
            mine |= {"moe.experts_gate_up": (e * 2 * mi, h), "moe.experts_down": (e * h, mi)}
            if s:
                mine |= {"moe.shared_gate_up": (2 * s, h), "moe.shared_down": (h, s)}
        else:
            inter = cfg.intermediate_size
            mine |= {"gate_up_proj": (2 * inter, h), "down_proj": (h, inter)}
        blocks += [(n, n * k) for name, (n, k) in mine.items()
                   if f"layers.{i}.{name}" not in scheme.skip]
    if scheme.lm_head and not cfg.tie_word_embeddings:
        blocks.append((cfg.vocab_size, cfg.vocab_size * h))
    return blocks
