"""The routed-experts MLP of Qwen2-MoE and Qwen3-MoE layers (+ Qwen2-MoE's shared expert).

A sparse layer's "after" part ends in :class:`SparseMoe` instead of the dense gate/up/down:
the router's top-k experts run on each token (``fused_moe``: per-expert weights packed at
load into ``experts_gate_up`` ``[E, 2I, H]`` and ``experts_down`` ``[E, H, I]``), and a
shared expert, when the checkpoint has one, adds ``sigmoid(shared_expert_gate(x)) *
shared(x)`` (``shared_combine``: on CUDA one launch that also computes the gate). The block
stays inside the "after" part, so graphs cut the chain at attention as for dense models.

The shared expert does not depend on the routed experts. While a CUDA graph is being
captured, for at most ``side_stream_max_tokens`` rows, it is issued on a side stream forked
from the main one after the routed experts are issued and joined back before the add, so
the replayed graph runs the two branches side by side. All layers share the model's one
side stream (``CausalLM.use_side_stream``): a capture adds one stream, not one per layer.
Outside capture everything runs in order on the current stream, with the same kernels and
so the same bits.

Under tensor parallelism ``cfg`` is one rank's shard (``model.parallel.shard_config``): each
expert holds ``moe_intermediate_size / N`` rows of gate and up and as many columns of down,
the shared expert likewise, and the router and the shared expert's gate are whole, so every
rank routes every token alike. The block's output is then this rank's partial sum (routed
plus gated shared); ``DecoderLayer.after`` all-reduces it once, after the join.
"""

from __future__ import annotations

import torch
from torch import nn

from replaylm.kernels import ref
from replaylm.model.config import ModelConfig
from replaylm.model.quant import Linear


class SparseMoe(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, e, i = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        self.top_k = cfg.num_experts_per_tok
        self.normalize = cfg.norm_topk_prob
        self.gate = nn.Linear(h, e, bias=False)  # the router
        self.experts_gate_up = nn.Parameter(torch.empty(e, 2 * i, h))
        self.experts_down = nn.Parameter(torch.empty(e, h, i))
        # The experts' per-row scales when they are FP8 (``model.quant``).
        self.register_parameter("experts_gate_up_scale", None)
        self.register_parameter("experts_down_scale", None)
        self.shared_gate_up = self.shared_down = self.shared_expert_gate = None
        s = cfg.shared_expert_intermediate_size
        if s:
            self.shared_gate_up = Linear(h, 2 * s, bias=False)
            self.shared_down = Linear(s, h, bias=False)
            self.shared_expert_gate = nn.Linear(h, 1, bias=False)
        # Set by CausalLM.use_side_stream: the model's one side stream and the row limit.
        self.side_stream: torch.cuda.Stream | None = None
        self.side_stream_max_tokens = 0
        self.forks = 0  # captures that forked onto the side stream (graph_stats reports them)

    def forward(self, x: torch.Tensor, kernels=None) -> torch.Tensor:
        """The MLP output of the normed rows ``x`` ``[T, H]``; ``kernels`` is ``kernels.ops``
        on CUDA (``ref`` when None)."""
        k = kernels or ref
        side = self._side_stream(x)
        if side is not None:
            main = torch.cuda.current_stream()
            side.wait_stream(main)  # fork: the side branch starts once x is ready
            self.forks += 1
        routed = self._routed(x, k)  # the main branch is issued first
        if self.shared_gate_up is None:
            return routed
        if side is None:
            shared = self._shared(x, k)
        else:
            with torch.cuda.stream(side):
                shared = self._shared(x, k)
            main.wait_stream(side)  # join before the add
            # Every tensor the side branch touches is released on the main stream only
            # after this join, and the next fork waits for the main stream, so no
            # allocation is reused while the other branch may still read it.
        return k.shared_combine(routed, shared, x, self.shared_expert_gate.weight)

    def _routed(self, x: torch.Tensor, k) -> torch.Tensor:
        logits = k.linear(x, self.gate.weight)
        weights, ids = k.route_topk(logits, self.top_k, self.normalize)
        return k.fused_moe(x, self.experts_gate_up, self.experts_down, weights, ids,
                           self.experts_gate_up_scale, self.experts_down_scale)

    def _shared(self, x: torch.Tensor, k) -> torch.Tensor:
        """The shared expert's MLP, before its gate (``shared_combine`` applies the gate)."""
        up, down = self.shared_gate_up, self.shared_down
        return k.silu_linear(k.linear(x, up.weight, scale=up.weight_scale), down.weight,
                             scale=down.weight_scale)

    def _side_stream(self, x: torch.Tensor) -> torch.cuda.Stream | None:
        """The side stream when this call forks: a shared expert, CUDA graph capture and at
        most ``side_stream_max_tokens`` rows (a host-known size: a tier decides the same way
        every time)."""
        if (self.side_stream is None or self.shared_gate_up is None
                or x.shape[0] > self.side_stream_max_tokens):
            return None
        return self.side_stream if torch.cuda.is_current_stream_capturing() else None
