"""Llama 2/3/3.x, Qwen2/2.5, Qwen3 and Qwen2/Qwen3-MoE decoders, as a chain graphs can cut.

Each layer splits at attention into a dense "before" part (residual add + norm, fused qkv,
q/k norm, rotary, KV write) and a dense "after" part (o_proj, residual add + norm, gate/up,
SiLU-and-mul, down). The model is then

    embed → before₀ → attn₀ → after₀+before₁ → attn₁ → … → after_{L-1} + final norm

and ``forward`` runs exactly these links in order: ``first_link``, then per layer
``attention`` and ``link`` (the last link is ``final_link``). A piecewise graph captures each
dense link; a full graph captures the whole of ``forward``. With the fused Triton kernels,
a decode step of at most ``rope_in_attention_max_reqs`` request slots (set by the runner)
ends its "before" part at the qkv projection, and the attention launch does the q/k norm,
rotary and KV write itself.

The dense ops come from ``kernels.ops`` (CUDA, fused Triton kernels) or ``kernels.ref``
(torch), which have the same names and signatures.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from replaylm.attention.backend import AttentionBackend
from replaylm.batch import AttentionMetadata
from replaylm.kernels import ref
from replaylm.kernels.ref import LoRAGroup
from replaylm.model.config import ModelConfig, rope_cos_sin
from replaylm.model.moe import SparseMoe
from replaylm.model.parallel import DataParallelAttention, TensorParallel
from replaylm.model.quant import Linear


def no_lora(group: str) -> LoRAGroup | None:
    """The LoRA hook of a model without adapters (``DecoderLayer.lora``): none."""
    return None


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps


class DecoderLayer(nn.Module):
    """One decoder layer; with ``tp`` its ``cfg`` holds one rank's heads and MLP width
    (``model.parallel``) and the row-parallel o_proj and down_proj outputs are all-reduced
    (a sparse layer's whole MoE block once, after its routed and shared branches join).
    With ``dp`` (data-parallel attention) it holds every head and one rank's MLP width: the
    MLP runs on every rank's tokens, all-gathered, and reduce-scatters its output."""

    def __init__(self, cfg: ModelConfig, index: int = 0, tp: TensorParallel | None = None,
                 dp: DataParallelAttention | None = None) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.cfg = cfg
        self.tp = tp
        self.dp = dp
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.qkv_proj = Linear(h, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.o_proj = Linear(cfg.q_size, h, bias=cfg.o_bias)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.moe = SparseMoe(cfg) if cfg.is_moe_layer(index) else None
        if self.moe is None:
            self.gate_up_proj = Linear(h, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
            self.down_proj = Linear(cfg.intermediate_size, h, bias=cfg.mlp_bias)
        self.kernels = None  # replaylm.kernels.ops on CUDA (see CausalLM.use_fused_kernels)
        # ``replaylm.lora``'s hook: ``lora(group)`` is a projection group's adapters (qkv, o,
        # gate_up, down) for the step; the projection op (``lora=``) shrinks the rows it
        # reads and adds their delta, keeping its fused prologue either way.
        self.lora = no_lora

    def before(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        slot_mapping: torch.Tensor,
        defer_rope: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual add + norm, qkv, (q/k norm), rotary, KV write; returns ``(q, residual)``.
        With ``defer_rope`` (fused kernels, decode steps) it stops after the projection and
        returns the raw ``qkv``: attention does the rest (``CausalLM.attention``)."""
        cfg = self.cfg
        k = self.kernels or ref
        norm_weight = self.input_layernorm.weight
        qkv, residual = k.norm_linear(hidden, residual, norm_weight, cfg.rms_norm_eps,
                                      self.qkv_proj.weight, self.qkv_proj.bias,
                                      scale=self.qkv_proj.weight_scale, lora=self.lora("qkv"))
        if defer_rope:
            return qkv, residual
        q, key, v = ref.split_qkv(qkv, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        q, _ = k.rotary(q, key, positions, cos_sin,
                        q_norm_weight=self.q_norm.weight if cfg.qk_norm else None,
                        k_norm_weight=self.k_norm.weight if cfg.qk_norm else None,
                        eps=cfg.rms_norm_eps, v=v, k_cache=kv_cache[0], v_cache=kv_cache[1],
                        slot_mapping=slot_mapping)
        return q, residual

    def after(self, attn_out: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """o_proj, residual add + norm, MLP; returns ``(mlp_out, residual)`` (add deferred).
        Biases (``attention_bias`` / ``mlp_bias`` checkpoints) go through the projections;
        a biased down_proj runs SiLU·mul and the projection apart (``silu_linear`` has none).
        A sparse layer's MLP is its routed experts (``model.moe``). With data-parallel
        attention the normed rows of every rank (``[ranks * T, hidden]``) go through this
        rank's MLP slice and each rank keeps the sum of its own ``T`` rows."""
        k = self.kernels or ref
        attn_rows = attn_out.flatten(1)
        hidden = k.linear(attn_rows, self.o_proj.weight, self.o_proj.bias,
                          scale=self.o_proj.weight_scale, lora=self.lora("o"))
        if self.tp is not None:
            hidden = self.tp.all_reduce(hidden)
        norm_weight, eps = self.post_attention_layernorm.weight, self.cfg.rms_norm_eps
        if self.moe is not None:
            normed, residual = k.add_rms_norm(hidden, residual, norm_weight, eps)
            out = self.moe(normed, self.kernels)  # this rank's routed + shared partial sum
            return (out if self.tp is None else self.tp.all_reduce(out)), residual
        if self.dp is not None:
            normed, residual = k.add_rms_norm(hidden, residual, norm_weight, eps)
            rows = self.dp.gather_rows(normed)
            gate_up = k.linear(rows, self.gate_up_proj.weight, self.gate_up_proj.bias,
                               scale=self.gate_up_proj.weight_scale)
            return self.dp.scatter_sum(self._down(gate_up, k)), residual
        # SiLU·mul runs in gate_up's epilogue where the kernels can (its rows are not needed
        # otherwise: the adapters of down shrink the activated rows), and down_proj is a
        # plain projection.
        act, residual = k.norm_linear(hidden, residual, norm_weight, eps,
                                      self.gate_up_proj.weight, self.gate_up_proj.bias,
                                      scale=self.gate_up_proj.weight_scale,
                                      lora=self.lora("gate_up"), silu_out=True)
        down = self.down_proj
        out = k.linear(act, down.weight, down.bias, scale=down.weight_scale,
                       lora=self.lora("down"))
        return (out if self.tp is None else self.tp.all_reduce(out)), residual

    def _down(self, gate_up: torch.Tensor, k) -> torch.Tensor:
        """SiLU·mul and down_proj (its bias, when any, on one rank only under parallelism)."""
        down = self.down_proj
        if down.bias is None:
            return k.silu_linear(gate_up, down.weight, scale=down.weight_scale)
        return k.linear(k.silu_and_mul(gate_up), down.weight, down.bias,
                        scale=down.weight_scale)


class CausalLM(nn.Module):
    """The decoder plus LM head. KV caches and the attention backend are bound by the runner.

    With ``tp`` (tensor parallel) ``cfg`` is this rank's shard (``model.parallel.shard_config``)
    and the embedding and LM head hold its ``tp.vocab_rows`` rows of the vocabulary. With
    ``dp`` (data-parallel attention, ``model.parallel.dp_attention_config``) only the MLP is
    split; the embedding and LM head are whole on every rank, which embeds and samples its
    own tokens.
    """

    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None,
                 dp: DataParallelAttention | None = None) -> None:
        super().__init__()
        assert tp is None or dp is None, "tensor parallelism or data-parallel attention"
        self.cfg = cfg
        self.tp = tp
        self.dp = dp
        vocab_rows = cfg.vocab_size if tp is None else tp.vocab_rows(cfg.vocab_size)
        # Given its weight, the embedding skips its random init: on the meta device that init
        # runs through torch's Python reference ops and imports torch._dynamo (seconds).
        self.embed_tokens = nn.Embedding(vocab_rows, cfg.hidden_size,
                                         _weight=torch.empty(vocab_rows, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp, dp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(
            cfg.hidden_size, vocab_rows, bias=False
        )
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.attn: AttentionBackend | None = None
        self.cos_sin: torch.Tensor | None = None
        self.scale = cfg.head_dim**-0.5
        # Debugging aid (CPU graph tests): padded tokens get NaN activations, so any padding
        # that leaks into a real row shows up as NaN in its logits.
        self.poison_padding = False
        self.kernels = None
        # Set by the runner: decode steps of at most this many request slots leave q/k norm,
        # rotary and the KV write to the attention launch (Triton backend, whole-model modes).
        self.rope_in_attention_max_reqs = 0

    def use_side_stream(self, max_tokens: int) -> None:
        """Let MoE layers run the shared expert on one side stream, made here for the whole
        model, while a CUDA graph of at most ``max_tokens`` rows is captured (0: never)."""
        device = self.embed_tokens.weight.device
        stream = torch.cuda.Stream(device) if max_tokens > 0 and device.type == "cuda" else None
        for layer in self.layers:
            if layer.moe is not None:
                layer.moe.side_stream = stream
                layer.moe.side_stream_max_tokens = max_tokens if stream is not None else 0

    def side_stream_forks(self) -> int:
        """How many times MoE layers have forked onto the side stream (during captures)."""
        return sum(layer.moe.forks for layer in self.layers if layer.moe is not None)

    def bind(
        self,
        attn: AttentionBackend,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        max_positions: int,
    ) -> None:
        """Attach the attention backend, the per-layer caches and the rotary table."""
        assert len(kv_caches) == self.cfg.num_layers
        self.attn = attn
        self.kv_caches = kv_caches
        self.cos_sin = rope_cos_sin(self.cfg, max_positions, self.embed_tokens.weight.device)

    def use_fused_kernels(self, enabled: bool) -> None:
        """Swap the torch ops of the dense links for the fused Triton kernels (CUDA only)."""
        mod = None
        if enabled:
            from replaylm.kernels import ops as mod
        for layer in self.layers:
            layer.kernels = mod
        self.kernels = mod

    @property
    def gather_embedding(self) -> torch.Tensor | None:
        """The embedding a step's input gather may look rows up in (``StaticBuffers.
        gather_inputs``); None with tensor parallelism, whose lookup is ``embed``."""
        return self.embed_tokens.weight if self.tp is None else None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows of ``input_ids``; vocab-parallel: each rank looks up the ids in its
        slice (zero rows for the others), then an all-reduce."""
        if self.tp is None:
            return self.embed_tokens(input_ids)
        rows = self.embed_tokens.weight.shape[0]
        local = input_ids - self.tp.rank * rows
        outside = (local < 0) | (local >= rows)
        hidden = torch.nn.functional.embedding(local.masked_fill(outside, 0),
                                               self.embed_tokens.weight)
        return self.tp.all_reduce(hidden.masked_fill(outside[:, None], 0))

    # The dense links of the chain ------------------------------------------------------------

    def first_link(self, input_ids, positions, meta: AttentionMetadata,
                   embedded: torch.Tensor | None = None):
        """Embedding (unless ``embedded`` holds the rows already) + before₀."""
        hidden = self.embed(input_ids) if embedded is None else embedded
        if self.poison_padding:
            # Tokens past the last request's end belong to no request: padding.
            pad = torch.arange(hidden.shape[0], device=hidden.device) >= meta.cu_seqlens_q[-1]
            hidden = hidden.masked_fill(pad[:, None], float("nan"))
        return self._before(0, hidden, None, positions, meta)

    def link(self, i: int, attn_out, residual, positions, meta: AttentionMetadata):
        """after_i + before_{i+1}."""
        hidden, residual = self.layers[i].after(attn_out, residual)
        return self._before(i + 1, hidden, residual, positions, meta)

    def final_link(self, attn_out, residual, rows: torch.Tensor | None = None) -> torch.Tensor:
        """after_last + the final norm, of ``rows`` only when given (in one launch on CUDA)."""
        hidden, residual = self.layers[-1].after(attn_out, residual)
        k = self.kernels or ref
        return k.add_rms_norm(hidden, residual, self.norm.weight, self.cfg.rms_norm_eps,
                              rows=rows)[0]

    def attention(self, i: int, q: torch.Tensor, meta: AttentionMetadata,
                  positions: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of layer ``i``. ``q`` is what ``before`` returned: the rotated q, or on a
        step that defers the rotary work (``_defer_rope``) the raw qkv, whose q/k norm,
        rotary and KV write then run inside the attention launch (which needs
        ``positions``)."""
        k_cache, v_cache = self.kv_caches[i]
        if not self._defer_rope(meta):
            return self.attn.forward(q, k_cache, v_cache, meta, self.scale)
        from replaylm.kernels.attention import RopeInputs

        cfg, layer = self.cfg, self.layers[i]
        assert positions is not None, "rotary inside attention needs the positions"
        q, k, v = ref.split_qkv(q, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        rope = RopeInputs(
            k=k, v=v, positions=positions, cos_sin=self.cos_sin, slot_mapping=meta.slot_mapping,
            q_norm_weight=layer.q_norm.weight if cfg.qk_norm else None,
            k_norm_weight=layer.k_norm.weight if cfg.qk_norm else None, eps=cfg.rms_norm_eps,
        )
        return self.attn.forward(q, k_cache, v_cache, meta, self.scale, rope=rope)

    def _defer_rope(self, meta: AttentionMetadata) -> bool:
        """Whether this step's attention does the rotary work (host-known: a graph tier
        always decides the same way)."""
        return meta.max_q_len == 1 and 0 < meta.num_reqs <= self.rope_in_attention_max_reqs

    def _before(self, i, hidden, residual, positions, meta):
        return self.layers[i].before(
            hidden, residual, positions, self.cos_sin, self.kv_caches[i], meta.slot_mapping,
            defer_rope=self._defer_rope(meta),
        )

    # Whole model ----------------------------------------------------------------------------

    def forward(self, input_ids, positions, meta: AttentionMetadata,
                embedded: torch.Tensor | None = None,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` after the final norm, for every packed token, or
        ``[R, hidden]`` for the token rows ``rows`` (int64). ``embedded``: the input ids'
        embedding rows, when the caller gathered them already (``StaticBuffers.gather_inputs``)."""
        q, residual = self.first_link(input_ids, positions, meta, embedded)
        last = self.cfg.num_layers - 1
        for i in range(last):
            q, residual = self.link(i, self.attention(i, q, meta, positions), residual,
                                    positions, meta)
        return self.final_link(self.attention(last, q, meta, positions), residual, rows)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of ``hidden``'s rows: fp32, or written into ``out`` (model dtype), which lets
        every graph share one static logits buffer instead of each keeping its own. With the
        fused kernels the latter is the projections' tuned ``linear`` (at a few rows the skinny
        kernel streams a large vocabulary's head faster than cuBLAS)."""
        head = self.lm_head
        weight = self.embed_tokens.weight if head is None else head.weight
        scale = None if head is None else head.weight_scale  # an FP8 head's (model.quant)
        if self.tp is not None:
            return self._gathered_logits(hidden, weight, out, scale)
        if out is None:
            return ref.linear(hidden, weight, scale=scale).float()
        return (self.kernels or ref).linear(hidden, weight, out=out, scale=scale)

    def _gathered_logits(self, hidden: torch.Tensor, weight: torch.Tensor,
                         out: torch.Tensor | None, scale: torch.Tensor | None = None,
                         ) -> torch.Tensor:
        """Vocab-parallel LM head: this rank's logits slice, all-gathered into the full
        vocabulary (the padding rows past it dropped), so every rank holds every logit."""
        local = (self.kernels or ref).linear(hidden, weight, scale=scale)
        parts = self.tp.all_gather(local)  # [ranks, rows, vocab_rows]
        full = parts.permute(1, 0, 2).reshape(hidden.shape[0], -1)[:, : self.cfg.vocab_size]
        if out is None:
            return full.float()
        return out.copy_(full)

    @torch.inference_mode()
    def run_dense_calls(self, num_rows: int) -> None:
        """Run every dense call of a decode step once on ``num_rows`` zero rows: one layer's
        projections with their fused prologues (first layer without a residual, later ones
        with), and the LM head into a logits buffer. With the fused kernels this decides each
        shape's kernel (``kernels.tuner``) before any capture. Writes only scratch KV block 0.
        """
        cfg = self.cfg
        weight = self.embed_tokens.weight
        zeros = functools.partial(torch.zeros, num_rows, dtype=weight.dtype, device=weight.device)
        slots = torch.zeros(num_rows, dtype=torch.long, device=weight.device)  # scratch block
        layer = self.layers[0]
        residual = None
        for res_in in (None, zeros(cfg.hidden_size)):
            _, residual = layer.before(zeros(cfg.hidden_size), res_in, slots, self.cos_sin,
                                       self.kv_caches[0], slots)
        # A dense and a sparse layer (MoE models may have both): every MLP shape.
        mlps = {layer.moe is None: layer for layer in self.layers}
        for mlp_layer in mlps.values():
            mlp_layer.after(zeros(cfg.num_heads, cfg.head_dim), residual)
        self.compute_logits(zeros(cfg.hidden_size), out=zeros(cfg.vocab_size))
