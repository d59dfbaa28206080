"""The model facts the engine needs, read from a Hugging Face config."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
_QKV_BIASED = ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
_QK_NORMED = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


@dataclass(frozen=True)
class ModelConfig:
    name: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    o_bias: bool = False  # o_proj bias (Llama/Qwen3 attention_bias)
    mlp_bias: bool = False  # gate/up/down biases (Llama mlp_bias)
    # Mixture of experts (Qwen2-MoE, Qwen3-MoE); num_experts 0 is a dense model. A layer is
    # sparse when it is not in ``mlp_only_layers`` and (i + 1) % decoder_sparse_step == 0;
    # the other layers keep a dense MLP of ``intermediate_size``.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to 1
    moe_intermediate_size: int = 0  # each routed expert's FFN width
    shared_expert_intermediate_size: int = 0  # 0: no shared expert (Qwen3-MoE)
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    @staticmethod
    def from_hf(hf: Any, name: str) -> ModelConfig:
        archs = list(getattr(hf, "architectures", None) or [])
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or getattr(hf, 'model_type', '?')!r} in {name}: "
                f"replaylm supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        heads = hf.num_attention_heads
        rope = dict(getattr(hf, "rope_parameters", None) or {})
        theta = float(rope.pop("rope_theta", getattr(hf, "rope_theta", 10000.0)))
        scaling = getattr(hf, "rope_scaling", None) if not rope else rope
        if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = None
        eos = getattr(hf, "eos_token_id", None)
        attention_bias = bool(getattr(hf, "attention_bias", False))
        moe = arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
        return ModelConfig(
            name=name,
            architecture=arch,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
            rms_norm_eps=hf.rms_norm_eps,
            rope_theta=theta,
            rope_scaling=dict(scaling) if scaling else None,
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            # Qwen2-MoE reads ``qkv_bias`` (default on); Qwen2 always has the biases.
            qkv_bias=(bool(getattr(hf, "qkv_bias", True)) if arch == "Qwen2MoeForCausalLM"
                      else arch == "Qwen2ForCausalLM" or attention_bias),
            qk_norm=arch in _QK_NORMED,
            bos_token_id=getattr(hf, "bos_token_id", None),
            eos_token_ids=_as_tuple(eos),
            # As transformers builds them: Qwen2's o_proj and MLP never have biases, Qwen3's
            # MLP neither; Llama's attention_bias covers o_proj too.
            o_bias=arch not in _QKV_BIASED and attention_bias,
            mlp_bias=arch == "LlamaForCausalLM" and bool(getattr(hf, "mlp_bias", False)),
            num_experts=int(hf.num_experts) if moe else 0,
            num_experts_per_tok=int(hf.num_experts_per_tok) if moe else 0,
            norm_topk_prob=moe and bool(hf.norm_topk_prob),
            moe_intermediate_size=int(hf.moe_intermediate_size) if moe else 0,
            shared_expert_intermediate_size=int(
                getattr(hf, "shared_expert_intermediate_size", 0) or 0) if moe else 0,
            decoder_sparse_step=int(getattr(hf, "decoder_sparse_step", 1) or 1) if moe else 1,
            mlp_only_layers=tuple(int(i) for i in (getattr(hf, "mlp_only_layers", None) or ())),
        )

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer ``i`` routes its MLP through experts (as transformers decides)."""
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def num_params(self) -> int:
        h, v = self.hidden_size, self.vocab_size
        qkv = h * (self.q_size + 2 * self.kv_size) + (self.q_size + 2 * self.kv_size) * self.qkv_bias
        per_layer = (qkv + self.q_size * h + h * self.o_bias + 2 * h
                     + 2 * self.head_dim * self.qk_norm)
        mlps = sum(self.mlp_params(n) for n in range(self.num_layers))
        return (v * h * (1 if self.tie_word_embeddings else 2) + self.num_layers * per_layer
                + mlps + h)

    @property
    def num_active_params(self) -> int:
        """Parameters one token reads: the top-k experts of each sparse layer, not all."""
        return self.num_params - sum(self.mlp_params(n) - self.mlp_params(n, active=True)
                                     for n in range(self.num_layers))

    def mlp_params(self, layer: int, active: bool = False) -> int:
        """Parameters of layer ``layer``'s MLP; with ``active`` only those one token reads
        (its top-k experts, the router and the shared expert)."""
        h, i = self.hidden_size, self.intermediate_size
        if not self.is_moe_layer(layer):
            return 3 * h * i + (2 * i + h) * self.mlp_bias
        experts = self.num_experts_per_tok if active else self.num_experts
        shared = self.shared_expert_intermediate_size
        return (experts * 3 * h * self.moe_intermediate_size + self.num_experts * h
                + (3 * h * shared + h if shared else 0))

    def weight_bytes(self, dtype: torch.dtype, active: bool = False) -> int:
        """Bytes of all weights, or with ``active`` of those one token reads (MoE: its
        top-k experts only)."""
        params = self.num_active_params if active else self.num_params
        return params * torch.empty((), dtype=dtype).element_size()

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * self.num_layers * self.kv_size * torch.empty((), dtype=dtype).element_size()


def _as_tuple(x: Any) -> tuple[int, ...]:
    if x is None:
        return ()
    return tuple(int(t) for t in x) if isinstance(x, list | tuple) else (int(x),)


def rope_cos_sin(cfg: ModelConfig, max_positions: int, device: torch.device) -> torch.Tensor:
    """A ``[max_positions, head_dim]`` fp32 table: cos in the first half, sin in the second."""
    # fp32 throughout, as transformers computes it, so positions round identically.
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    elif kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind != "default":
        raise ValueError(f"unsupported rope scaling {kind!r}: replaylm supports default, linear, llama3")
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq.float())
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1 frequency-dependent scaling: long wavelengths slowed by `factor`, short ones kept,
    # a smooth blend between the two thresholds.
    factor, lo, hi = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - lo) / (hi - lo)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
    mid = (wavelen <= old_len / lo) & (wavelen >= old_len / hi)
    return torch.where(mid, blended, out)
