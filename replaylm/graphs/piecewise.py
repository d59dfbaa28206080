"""Piecewise graphs: each dense link of the model chain captured per token tier; attention
runs eagerly between the replays, through static link buffers.

The chain is ``embed+before₀ → attn₀ → after₀+before₁ → … → after_last+final norm``
(``model.llama``): link 0 reads the step's inputs and writes ``q`` and the residual, link
``j`` reads attention's output and the residual, the last link writes the normed hidden
states. Links read no per-request field but ``cu_seqlens_q``'s end (for the padding poison
of the debug mode), so one set of graphs serves any batch whose token count fits the tier.
"""

from __future__ import annotations

import torch

from replaylm.batch import ForwardBatch, HostBatch, set_host_lengths
from replaylm.graphs.buffers import StaticBuffers
from replaylm.graphs.graph import Graph, check_bits
from replaylm.model.llama import CausalLM


class PiecewiseGraphs:
    """The link graphs of every token tier, sharing one set of link buffers."""

    NUM_LINK_BUFFERS = 4  # q, attention output, residual, hidden: [top_tier, hidden-ish]

    def __init__(self, model: CausalLM, buffers: StaticBuffers, top_tier: int,
                 host_attn_lengths: bool) -> None:
        self.model, self.buffers = model, buffers
        self.host_attn_lengths = host_attn_lengths
        cfg, weight = model.cfg, model.embed_tokens.weight
        self.q_buf = torch.zeros(top_tier, cfg.num_heads, cfg.head_dim, dtype=weight.dtype,
                                 device=weight.device)
        self.attn_buf = torch.zeros_like(self.q_buf)
        self.res_buf = torch.zeros(top_tier, cfg.hidden_size, dtype=weight.dtype,
                                   device=weight.device)
        self.hidden_buf = torch.zeros_like(self.res_buf)
        self.links: dict[int, list[Graph]] = {}

    @classmethod
    def static_bytes(cls, q_size: int, top_tier: int, dtype: torch.dtype) -> int:
        """Upper bound of the static memory this runner adds: the link buffers."""
        return cls.NUM_LINK_BUFFERS * top_tier * q_size * dtype.itemsize

    def getters(self) -> dict[str, object]:
        return {n: (lambda n=n: getattr(self, n))
                for n in ("q_buf", "attn_buf", "res_buf", "hidden_buf")}

    @property
    def num_links(self) -> int:
        return self.model.cfg.num_layers + 1

    def _link(self, j: int, b: ForwardBatch, attn_in: torch.Tensor, res_in: torch.Tensor):
        """Dense link ``j`` of the chain: 0 is embed+before₀, the last ends in the final norm."""
        m = self.model
        if j == 0:
            return list(m.first_link(b.input_ids, b.positions, b.meta))
        if j == m.cfg.num_layers:
            return [m.final_link(attn_in, res_in)]
        return list(m.link(j - 1, attn_in, res_in, b.positions, b.meta))

    def _link_outputs(self, j: int, t: int) -> list[torch.Tensor]:
        last = j == self.model.cfg.num_layers
        return [self.hidden_buf[:t]] if last else [self.q_buf[:t], self.res_buf[:t]]

    def capture(self, tier: int, new_graph) -> int | None:
        """Capture every link of ``tier`` (``new_graph(name)`` makes each ``Graph``); returns
        their total node count."""
        b = self.buffers.view(tier, self.buffers.max_reqs, 0, max_q_len=tier)
        attn_in, res_in = self.attn_buf[:tier], self.res_buf[:tier]
        graphs = []
        for j in range(self.num_links):
            outs = self._link_outputs(j, tier)

            def run(j=j, outs=outs) -> list[torch.Tensor]:
                for dst, src in zip(outs, self._link(j, b, attn_in, res_in)):
                    dst.copy_(src)
                return outs

            g = new_graph(f"piecewise:{tier}:link{j}")
            g.capture(run)
            graphs.append(g)
        self.links[tier] = graphs
        counts = [g.num_nodes() for g in graphs]
        return None if None in counts else sum(counts)

    def run(self, host: HostBatch, tier: int, check: str | None = None
            ) -> tuple[torch.Tensor, ForwardBatch]:
        """Replay ``tier``'s links with eager attention between them; returns the logits rows
        and the batch. With ``check``, each link is also run eagerly and compared."""
        nreq = max(host.num_reqs, 1)  # an empty batch (a data-parallel dummy): one padded
        self.buffers.load(host, tier, nreq, host.num_sampled)
        b = self.buffers.view(tier, nreq, host.num_sampled, max_q_len=max(host.max_q_len, 1))
        if self.host_attn_lengths:  # eager attention may read host lengths (torch reference)
            set_host_lengths(b.meta, host)
        self.buffers.gather_inputs(b)
        graphs = self.links[tier]
        attn_in, res_in = self.attn_buf[:tier], self.res_buf[:tier]
        for j, g in enumerate(graphs):
            snapshot = [attn_in.clone(), res_in.clone()] if check else None
            g.replay()
            if check:
                eager = self._link(j, b, *snapshot)
                check_bits(g.outputs, eager, f"{check}, first differing segment: link {j}")
            if j < len(graphs) - 1:
                attn_in.copy_(self.model.attention(j, self.q_buf[:tier], b.meta))
        hidden = self.hidden_buf[:tier].index_select(0, b.logits_indices)
        return self.model.compute_logits(hidden), b
