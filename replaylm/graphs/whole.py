"""Whole-model graphs: one capture of the entire step per tier (``full`` and ``ragged``).

A step on the device is: inputs gathered and embedded (one launch), the model with its final
norm on the logits rows only, the LM head into the shared logits buffer, the structured-output
token masks of constrained rows (``sampling.bitmask``), and greedy samples written to
``last_token``. ``full`` graphs are keyed by request count, every request one
token (``tier`` tokens, ``tier`` slots); ``ragged`` graphs by total tokens, with
``min(tier, S)`` request slots, so any mix of query lengths whose total fits replays one
graph.
"""

from __future__ import annotations

import torch

from replaylm.batch import ForwardBatch, HostBatch
from replaylm.graphs.buffers import StaticBuffers
from replaylm.graphs.graph import Graph, check_bits
from replaylm.model.llama import CausalLM
from replaylm.sampling.bitmask import apply_token_bitmask
from replaylm.sampling.sampler import argmax_rows


def run_whole_model(model: CausalLM, buffers: StaticBuffers, b: ForwardBatch,
                    out: torch.Tensor | None = None, gather: bool = True,
                    masks: bool = True) -> list[torch.Tensor]:
    """The step on the device: ``[logits, greedy]``. ``gather=False`` reuses the inputs a
    replay already gathered (the graph check re-runs a replayed step). Eager steps run this
    too, unpadded; ``masks=False`` (an eager step while no slot is constrained) skips the
    structured-output masks, which would change nothing."""
    embedded = None
    if gather and b.gather is not None:
        embedded = buffers.gather_inputs(b, model.gather_embedding,
                                         fused=model.kernels is not None)
    hidden = model(b.input_ids, b.positions, b.meta, embedded, rows=b.logits_indices)
    logits = model.compute_logits(hidden, out)
    # Structured outputs: constrained rows' forbidden tokens to -inf (rows of unconstrained
    # slots untouched), before the greedy argmax and the sampler read the logits.
    if masks:
        apply_token_bitmask(logits, buffers.token_bitmask, buffers.bitmask_on, b.sample_slots)
    return [logits, argmax_rows(logits, buffers.last_token, b.sample_slots)]


class WholeModelGraphs:
    """The ``full`` and ``ragged`` graphs of one runtime, sharing one logits buffer."""

    def __init__(self, model: CausalLM, buffers: StaticBuffers, max_num_seqs: int,
                 top_tier: int) -> None:
        self.model, self.buffers, self.max_num_seqs = model, buffers, max_num_seqs
        # Logits rows of a ragged graph: one per request slot, or more when verify steps
        # sample several rows per request (``buffers.max_logits``); never above the tier.
        self.max_logits = buffers.max_logits
        # One logits output shared by every graph (each keeping its own [rows, vocab] output
        # would cost gigabytes across the tiers).
        weight = model.embed_tokens.weight
        self.logits_buf = torch.zeros(min(top_tier, self.max_logits), model.cfg.vocab_size,
                                      dtype=weight.dtype, device=weight.device)
        self.graphs: dict[tuple[str, int], Graph] = {}

    @staticmethod
    def static_bytes(vocab_size: int, top_tier: int, max_logits: int) -> int:
        """Upper bound of the static memory this runner adds: the shared logits buffer."""
        return min(top_tier, max_logits) * vocab_size * 4

    def getters(self) -> dict[str, object]:
        return {"logits_buf": lambda: self.logits_buf}

    def view(self, mode: str, tier: int) -> ForwardBatch:
        if mode == "full":
            return self.buffers.view(tier, tier, tier, max_q_len=1)
        slots = min(tier, self.max_num_seqs)
        return self.buffers.view(tier, slots, min(tier, self.max_logits), max_q_len=tier)

    def capture(self, mode: str, tier: int, graph: Graph) -> int | None:
        """Capture the step of ``mode``'s ``tier`` into ``graph``; returns its node count."""
        batch = self.view(mode, tier)
        out = self.logits_buf[: len(batch.logits_indices)]
        graph.capture(lambda: run_whole_model(self.model, self.buffers, batch, out))
        self.graphs[(mode, tier)] = graph
        return graph.num_nodes()

    def run(self, host: HostBatch, mode: str, tier: int, check: str | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, ForwardBatch]:
        """Replay ``mode``'s ``tier`` graph on ``host`` (padded); with ``check`` (the check's
        label), also run the same kernels eagerly and compare bit for bit."""
        batch = self.view(mode, tier)
        self.buffers.load(host, tier, batch.meta.num_reqs, len(batch.logits_indices))
        g = self.graphs[(mode, tier)]
        g.replay()
        logits, greedy = g.outputs
        if check:  # into a scratch buffer of the same shape and dtype; inputs as the replay
            # gathered them (it has overwritten last_token since)
            eager = run_whole_model(self.model, self.buffers, batch, torch.empty_like(logits),
                                    gather=False)
            check_bits(g.outputs, eager, f"{check}, first differing segment: whole model")
        return logits, greedy, batch
