"""Whole-model graphs: one capture of the entire step per tier (``full`` and ``ragged``).

A step on the device is its forward (``step_logits``: inputs gathered and embedded in one
launch, the model with its final norm on the logits rows only, the LM head into the shared
logits buffer) and its tail (``step_tail``: the structured-output token masks of constrained
rows, ``sampling.bitmask``, then the samples written to ``last_token``: one launch that
takes each greedy row's argmax and draws each other row at its temperature). ``full`` graphs
are keyed by request count, every request one token (``tier`` tokens, ``tier`` slots);
``ragged`` graphs by total tokens, with ``min(tier, S)`` request slots, so any mix of query
lengths whose total fits replays one graph.

Each tier holds two graphs, captured in this order into the runtime's one pool: the step
graph (the forward and the samples, without masks) and a tail graph (the tail alone, two
nodes on CUDA: the mask and the sampler). A step replays the step graph. Only a step that
samples a constrained request needs masks, and the engine fills those while its forward
runs (``run``'s ``between``, ``structured.masks``): it replays the step graph, runs
``between``, then replays the tail graph, which masks the logits in place and samples
again. Unconstrained steps thus keep one graph launch and no mask node; a constrained step
costs one more launch and, on the device, the step graph's samples the tail recomputes.
The tail graph reads only static buffers (the logits buffer, masks, flags, sampled slots,
the sampling settings); its own memory is the samples it returns and the sampler's
per-chunk partials (a few KiB), so it adds next to no graph memory.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from replaylm.batch import ForwardBatch, HostBatch
from replaylm.graphs.buffers import StaticBuffers
from replaylm.graphs.graph import Graph, check_bits
from replaylm.model.llama import CausalLM
from replaylm.sampling.bitmask import apply_token_bitmask
from replaylm.sampling.sampler import argmax_rows, race_rows


def step_logits(model: CausalLM, buffers: StaticBuffers, b: ForwardBatch,
                out: torch.Tensor | None = None, gather: bool = True) -> torch.Tensor:
    """The step's forward on the device: the logits rows (into ``out`` when given).
    ``gather=False`` reuses the inputs a replay already gathered (the graph check)."""
    embedded = None
    if gather and b.gather is not None:
        embedded = buffers.gather_inputs(b, model.gather_embedding,
                                         fused=model.kernels is not None)
    hidden = model(b.input_ids, b.positions, b.meta, embedded, rows=b.logits_indices)
    return model.compute_logits(hidden, out)


def step_tail(buffers: StaticBuffers, logits: torch.Tensor, b: ForwardBatch,
              masks: bool = True) -> torch.Tensor:
    """The step's tail on the device: constrained rows' forbidden tokens to ``-inf`` in place
    (rows of unconstrained slots untouched), then the samples, also written to ``last_token``:
    with ``buffers.sampling``, each row drawn by its slot's settings (the argmax, or the race
    at its temperature, ``sampling.sampler.race_rows``), else the argmax of every row. A step
    whose rows need more (top-k / top-p, penalties, logprobs) samples again from the masked
    logits after it. ``masks=False`` (an eager step while no slot is constrained) skips the
    masks, which would change nothing."""
    if masks:
        apply_token_bitmask(logits, buffers.token_bitmask, buffers.bitmask_on, b.sample_slots)
    if buffers.sampling is None:
        return argmax_rows(logits, buffers.last_token, b.sample_slots)
    return race_rows(logits, b.sample_slots, b.sample_out_pos, buffers.sampling,
                     dest=buffers.last_token)


def run_whole_model(model: CausalLM, buffers: StaticBuffers, b: ForwardBatch,
                    out: torch.Tensor | None = None, gather: bool = True,
                    masks: bool = True) -> list[torch.Tensor]:
    """The whole step, forward then tail: ``[logits, samples]``. Eager steps run this too,
    unpadded."""
    logits = step_logits(model, buffers, b, out, gather)
    return [logits, step_tail(buffers, logits, b, masks)]


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
        self.tails: dict[tuple[str, int], Graph] = {}  # the tail graph of each step graph

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

    def capture(self, mode: str, tier: int, graph: Graph, tail: Graph | None
                ) -> tuple[int | None, int | None]:
        """Capture the step of ``mode``'s ``tier`` into ``graph``, then (unless ``tail`` is
        None) its tail alone into ``tail``; returns their node counts."""
        batch = self.view(mode, tier)
        out = self.logits_buf[: len(batch.logits_indices)]
        graph.capture(lambda: run_whole_model(self.model, self.buffers, batch, out,
                                              masks=False))
        self.graphs[(mode, tier)] = graph
        if tail is None:
            return graph.num_nodes(), None
        tail.capture(lambda: [step_tail(self.buffers, out, batch)])
        self.tails[(mode, tier)] = tail
        return graph.num_nodes(), tail.num_nodes()

    def run(self, host: HostBatch, mode: str, tier: int, check: str | None = None,
            between: Callable[[torch.Tensor], None] | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, ForwardBatch]:
        """Replay ``mode``'s ``tier`` graph on ``host`` (padded). With ``between``, call it
        with the logits once the step graph is launched, then replay the tail graph. With
        ``check`` (the check's label), also run the same kernels eagerly and compare bit for
        bit."""
        batch = self.view(mode, tier)
        self.buffers.load(host, tier, batch.meta.num_reqs, len(batch.logits_indices))
        g = self.graphs[(mode, tier)]
        g.replay()
        logits, samples = g.outputs
        if between is not None:
            between(logits)
            tail = self.tails[(mode, tier)]
            tail.replay()
            samples = tail.outputs[0]
        if check:  # into a scratch buffer of the same shape and dtype; inputs as the replay
            # gathered them (it has overwritten last_token since)
            eager = run_whole_model(self.model, self.buffers, batch, torch.empty_like(logits),
                                    gather=False)
            check_bits([logits, samples], eager,
                       f"{check}, first differing segment: whole model")
        return logits, samples, batch
