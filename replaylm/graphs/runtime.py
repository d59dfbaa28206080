"""The graph runtime: every step of the model runs here, as a graph replay or eagerly.

Modes (DESIGN.md, "Graph modes"):

- ``eager``: nothing captured.
- ``full``: the whole model + logits per decode batch-size tier (each request one token).
- ``piecewise``: each dense link of the model chain per token tier; attention runs eagerly
  between replays through static buffers. Serves any batch up to the top tier.
- ``full_and_piecewise``: both; the dispatcher picks full for uniform decode.
- ``ragged``: the whole model per total-token tier with ``min(tier, max_num_seqs)`` request
  slots; any mix of query lengths that fits replays the same graph.

Every graph-relevant decision (mode, tier, padding, fallback) is made in ``dispatch``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from replaylm.config import PIECEWISE_MODES
from replaylm.engine.batch import ForwardBatch, HostBatch, to_device
from replaylm.graphs.buffers import StaticBuffers
from replaylm.graphs.capture import gc_paused
from replaylm.graphs.stand_in import StandInGraph
from replaylm.graphs.tiers import round_up
from replaylm.model.llama import CausalLM
from replaylm.sampling.sampler import argmax_rows

log = logging.getLogger(__name__)


class GraphCheckError(AssertionError):
    """A replay differs from the eager run of the same padded batch."""


class PaddingLeakError(AssertionError):
    """With ``poison_padding``, a real row came out NaN: padding reached it."""


@dataclass
class GraphStats:
    hits: dict[str, int] = field(default_factory=dict)  # "mode:tier" -> steps
    fallbacks: dict[str, int] = field(default_factory=dict)  # reason -> steps
    real_tokens: int = 0
    padded_tokens: int = 0
    num_graphs: int = 0
    nodes: dict[str, int] = field(default_factory=dict)  # "mode:tier" -> graph nodes per step
    capture_seconds: float = 0.0
    graph_mib: float = 0.0
    checks: int = 0

    def as_dict(self) -> dict:
        return {
            "hits": dict(self.hits), "fallbacks": dict(self.fallbacks),
            "real_tokens": self.real_tokens, "padded_tokens": self.padded_tokens,
            "padding_share": round(1 - self.real_tokens / self.padded_tokens, 4)
            if self.padded_tokens else 0.0,
            "num_graphs": self.num_graphs, "nodes": dict(self.nodes),
            "capture_seconds": round(self.capture_seconds, 3),
            "graph_mib": round(self.graph_mib, 1), "checks": self.checks,
        }


@dataclass
class Dispatch:
    kind: str  # eager | full | piecewise | ragged
    tier: int | None = None
    reason: str | None = None  # why a step fell back to eager


@dataclass
class StepResult:
    logits: torch.Tensor  # [L_real, V]
    greedy: torch.Tensor | None  # [L_real] argmax tokens, already in last_token (None: not run)
    batch: ForwardBatch  # the sampling rows live in batch.sample_* [:L_real]
    dispatch: Dispatch
    padded_tokens: int


class _Graph:
    """A CUDA graph, or on CPU the stand-in that checks the same invariants."""

    def __init__(self, name: str, device: torch.device, pool, static_getters) -> None:
        self.name, self.device, self.pool, self.static = name, device, pool, static_getters
        self.cuda = device.type == "cuda"
        # keep_graph: the cudaGraph_t stays readable after instantiation, to count its nodes.
        self.graph = _cuda_graph() if self.cuda else StandInGraph(name)
        self.outputs: list[torch.Tensor] = []

    def capture(self, fn: Callable[[], Sequence[torch.Tensor]]) -> list[torch.Tensor]:
        if not self.cuda:
            self.outputs = self.graph.capture(fn, self.static)
            return self.outputs
        for _ in range(2):  # warm-up: JIT, autotune and library handles before capture
            fn()
        torch.cuda.synchronize(self.device)
        with gc_paused(), torch.cuda.graph(self.graph, pool=self.pool):
            self.outputs = list(fn())
        if hasattr(self.graph, "instantiate"):
            self.graph.instantiate()  # a kept graph is instantiated on demand: do it now
        return self.outputs

    def replay(self) -> None:
        self.graph.replay()

    def num_nodes(self) -> int | None:
        """Nodes (kernels and copies) in the graph; ``None`` where they cannot be counted."""
        if not self.cuda:
            return self.graph.num_nodes
        try:
            from cuda.bindings import runtime as cudart

            raw = self.graph.raw_cuda_graph()
            handle = cudart.cudaGraph_t(init_value=raw) if isinstance(raw, int) else raw
            err, _, count = cudart.cudaGraphGetNodes(handle, 0)
            return int(count) if int(err) == 0 else None
        except Exception as e:  # cuda-python missing, or a torch without raw_cuda_graph()
            log.debug("graph node count unavailable: %s", e)
            return None


class GraphRuntime:
    """Runs every step: dispatches it to a graph (or eagerly) on the persistent buffers."""

    def __init__(self, model: CausalLM, mode: str, device: torch.device, *, max_num_seqs: int,
                 max_blocks: int, max_model_len: int, decode_tiers: list[int],
                 token_tiers: list[int], host_attn_lengths: bool, eager_tokens: int,
                 graph_check: int = 0) -> None:
        self.model, self.mode, self.device = model, mode, device
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        self.host_attn_lengths = host_attn_lengths
        self.graph_check = graph_check
        self.uses_full = mode in ("full", "full_and_piecewise")
        self.uses_piecewise = mode in PIECEWISE_MODES
        self.decode_tiers = decode_tiers if self.uses_full else []
        self.token_tiers = token_tiers if (self.uses_piecewise or mode == "ragged") else []
        self.stats = GraphStats()
        self.graph_steps = 0
        self.full: dict[int, _Graph] = {}
        self.ragged: dict[int, _Graph] = {}
        self.piecewise: dict[int, list[_Graph]] = {}
        top_graph = max(self.decode_tiers + self.token_tiers, default=0)
        # Eager steps up to ``eager_tokens`` also run on the static buffers (one copy in).
        top_tokens = max(top_graph, eager_tokens)
        self.buffers = StaticBuffers(top_tokens, min(top_tokens, max_num_seqs), max_num_seqs,
                                     max_blocks, device, max_model_len)
        self.last_token = self.buffers.last_token
        if mode != "eager":
            cfg = model.cfg
            dtype = model.embed_tokens.weight.dtype
            # One logits output shared by every whole-model graph (each graph keeping its own
            # [rows, vocab] output would cost gigabytes across the tiers).
            self.logits_buf = torch.zeros(min(top_graph, max_num_seqs), cfg.vocab_size,
                                          dtype=dtype, device=device)
            if self.uses_piecewise:  # the links' static inputs/outputs, shared by every tier
                self.q_buf = torch.zeros(top_graph, cfg.num_heads, cfg.head_dim, dtype=dtype,
                                         device=device)
                self.attn_buf = torch.zeros_like(self.q_buf)
                self.res_buf = torch.zeros(top_graph, cfg.hidden_size, dtype=dtype,
                                           device=device)
                self.hidden_buf = torch.zeros_like(self.res_buf)

    # Dispatch ----------------------------------------------------------------------------

    def dispatch(self, host: HostBatch) -> Dispatch:
        if self.mode == "eager":
            return Dispatch("eager")
        reason = None
        if self.uses_full:
            if host.is_uniform_decode:
                tier = round_up(self.decode_tiers, host.num_reqs)
                if tier is not None:
                    return Dispatch("full", tier)
                reason = f"decode batch {host.num_reqs} above top full tier {self.decode_tiers[-1]}"
            else:
                reason = "not a uniform decode batch"
        if self.token_tiers:
            tier = round_up(self.token_tiers, host.num_tokens)
            if tier is not None:
                return Dispatch("piecewise" if self.uses_piecewise else "ragged", tier)
            reason = f"{host.num_tokens} tokens above top token tier {self.token_tiers[-1]}"
        return Dispatch("eager", reason=reason)

    # Capture -----------------------------------------------------------------------------

    def capture(self) -> None:
        if self.mode == "eager":
            return
        pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        getters = self.buffers.getters() | {"logits_buf": lambda: self.logits_buf}
        if self.uses_piecewise:
            getters |= {n: (lambda n=n: getattr(self, n))
                        for n in ("q_buf", "attn_buf", "res_buf", "hidden_buf")}
        jobs = [("full", t) for t in self.decode_tiers] + [
            ("piecewise" if self.uses_piecewise else "ragged", t) for t in self.token_tiers]
        jobs.sort(key=lambda j: -j[1])  # largest first: smaller ones reuse its pool memory
        if self.device.type == "cuda":
            # Cached free blocks would be handed back under memory pressure during capture and
            # make the graphs' memory read low (even negative): start from a trimmed cache.
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        before = _reserved(self.device)
        start = time.perf_counter()
        with torch.inference_mode():
            for kind, tier in tqdm(jobs, desc=f"capturing {self.mode} graphs", unit="graph",
                                   disable=len(jobs) < 2):
                self._dummy_batch()
                if kind == "piecewise":
                    links = [self._capture_link(j, tier, pool, getters)
                             for j in range(self.model.cfg.num_layers + 1)]
                    self.piecewise[tier] = links
                    counts = [g.num_nodes() for g in links]
                    nodes = None if None in counts else sum(counts)
                else:
                    g = _Graph(f"{kind}:{tier}", self.device, pool, getters)
                    batch = self._view(kind, tier)
                    out = self.logits_buf[: len(batch.logits_indices)]
                    g.capture(lambda b=batch, o=out: self._whole_model(b, o))
                    (self.full if kind == "full" else self.ragged)[tier] = g
                    nodes = g.num_nodes()
                if nodes is not None:
                    self.stats.nodes[f"{kind}:{tier}"] = nodes
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        s = self.stats
        s.capture_seconds = time.perf_counter() - start
        s.num_graphs = len(self.full) + len(self.ragged) + sum(map(len, self.piecewise.values()))
        s.graph_mib = (_reserved(self.device) - before) / 2**20
        log.info("captured %d graphs (modes %s) in %.2f s, %.1f MiB", s.num_graphs,
                 ",".join(sorted({k for k, _ in jobs})), s.capture_seconds, s.graph_mib)

    def _view(self, kind: str, tier: int) -> ForwardBatch:
        if kind == "full":
            return self.buffers.view(tier, tier, tier, max_q_len=1)
        slots = min(tier, self.max_num_seqs)
        return self.buffers.view(tier, slots, slots, max_q_len=tier)

    def _dummy_batch(self) -> None:
        """Fill the static buffers with an all-padding batch: every token writes block 0,
        reads token 0, and samples into the scratch slot."""
        b = self.buffers
        for t in (b.input_ids, b.positions, b.slot_mapping, b.kv_lens, b.cu_seqlens_q,
                  b.block_table, b.logits_indices, b.sample_out_pos):
            t.zero_()
        b.gather.fill_(b.num_slots + 1)
        b.req_slots.fill_(b.scratch_slot)
        b.sample_slots.fill_(b.scratch_slot)

    def _whole_model(self, b: ForwardBatch, out: torch.Tensor | None = None,
                     gather: bool = True) -> list[torch.Tensor]:
        """The step on the device: inputs gathered and embedded, the model (its final norm on
        the logits rows only), logits, and greedy samples (written to ``last_token``; a
        sampler that draws otherwise overwrites them)."""
        m = self.model
        embedded = None
        if gather and b.gather is not None:
            embedded = self.buffers.gather_inputs(b, m.embed_tokens.weight,
                                                  fused=m.kernels is not None)
        hidden = m(b.input_ids, b.positions, b.meta, embedded, rows=b.logits_indices)
        logits = m.compute_logits(hidden, out)
        return [logits, self._greedy(logits, b)]

    def _greedy(self, logits: torch.Tensor, b: ForwardBatch) -> torch.Tensor:
        return argmax_rows(logits, self.last_token, b.sample_slots)

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

    def _capture_link(self, j: int, tier: int, pool, getters) -> _Graph:
        # Links read no per-request field but cu_seqlens_q's end (padding poison in debug mode).
        b = self.buffers.view(tier, self.buffers.max_reqs, 0, max_q_len=tier)
        attn_in, res_in = self.attn_buf[:tier], self.res_buf[:tier]
        outs = self._link_outputs(j, tier)

        def run() -> list[torch.Tensor]:
            for dst, src in zip(outs, self._link(j, b, attn_in, res_in)):
                dst.copy_(src)
            return outs

        g = _Graph(f"piecewise:{tier}:link{j}", self.device, pool, getters)
        g.capture(run)
        return g

    # Replay ------------------------------------------------------------------------------

    def run(self, host: HostBatch) -> StepResult:
        d = self.dispatch(host)
        s = self.stats
        n = host.num_sampled
        if d.kind == "eager":
            if d.reason:
                s.fallbacks[d.reason] = s.fallbacks.get(d.reason, 0) + 1
            batch = self.eager_batch(host)
            logits, greedy = self._whole_model(batch)
            return StepResult(logits, greedy, batch, d, host.num_tokens)
        key = f"{d.kind}:{d.tier}"
        s.hits[key] = s.hits.get(key, 0) + 1
        s.real_tokens += host.num_tokens
        s.padded_tokens += d.tier
        self.graph_steps += 1
        check = self.graph_check > 0 and self.graph_steps % self.graph_check == 0
        if d.kind == "piecewise":
            logits, greedy, batch = self._run_piecewise(host, d.tier, check)
        else:
            batch = self._view(d.kind, d.tier)
            self.buffers.load(host, d.tier, batch.meta.num_reqs, len(batch.logits_indices))
            g = (self.full if d.kind == "full" else self.ragged)[d.tier]
            g.replay()
            logits, greedy = g.outputs
            if check:  # the same kernels into a scratch buffer of the same shape and dtype
                # Inputs as the replay gathered them: it has overwritten last_token since.
                eager = self._whole_model(batch, torch.empty_like(logits), gather=False)
                self._check(key, g.outputs, eager, "whole model")
        if self.model.poison_padding and n and not bool(torch.isfinite(logits[:n]).all()):
            # A debugging mode, so this host sync is acceptable; it runs after the replay.
            raise PaddingLeakError(f"padding leaked into real rows: mode {self.mode}, graph {key}")
        return StepResult(logits[:n], greedy[:n], batch, d, d.tier)

    def eager_batch(self, host: HostBatch) -> ForwardBatch:
        """An unpadded eager step: on the static buffers when it fits, else fresh tensors."""
        b = self.buffers
        if not b.fits(host):
            return to_device(host, self.last_token, b.slot_tables, self.device,
                             self.host_attn_lengths)
        b.load(host, host.num_tokens, host.num_reqs, host.num_sampled)
        batch = b.view(host.num_tokens, host.num_reqs, host.num_sampled, host.max_q_len,
                       max_kv_len=int(host.kv_lens.max()))
        self._host_lengths(batch, host)
        return batch

    def _host_lengths(self, batch: ForwardBatch, host: HostBatch) -> None:
        if self.host_attn_lengths:  # eager attention may use host lengths (torch reference)
            batch.meta.cu_seqlens_q_cpu = host.cu_seqlens_q.tolist()
            batch.meta.kv_lens_cpu = host.kv_lens.tolist()

    def _run_piecewise(self, host: HostBatch, tier: int, check: bool):
        nreq = host.num_reqs
        self.buffers.load(host, tier, nreq, host.num_sampled)
        b = self.buffers.view(tier, nreq, host.num_sampled, max_q_len=host.max_q_len)
        self._host_lengths(b, host)
        self.buffers.gather_inputs(b)
        graphs = self.piecewise[tier]
        attn_in, res_in = self.attn_buf[:tier], self.res_buf[:tier]
        for j, g in enumerate(graphs):
            snapshot = [attn_in.clone(), res_in.clone()] if check else None
            g.replay()
            if check:
                eager = self._link(j, b, *snapshot)
                self._check(f"piecewise:{tier}", g.outputs, eager, f"link {j}")
            if j < len(graphs) - 1:
                attn_in.copy_(self.model.attention(j, self.q_buf[:tier], b.meta))
        logits = self.model.compute_logits(self.hidden_buf[:tier].index_select(0, b.logits_indices))
        return logits, self._greedy(logits, b), b

    def _check(self, key: str, graph_out, eager_out, segment: str) -> None:
        self.stats.checks += 1
        for i, (g, e) in enumerate(zip(graph_out, eager_out)):
            # Bit-for-bit, so NaN rows of (poisoned) padding compare equal to themselves.
            if not torch.equal(_bits(g), _bits(e)):
                diff = (g.float() - e.float()).abs().nan_to_num(float("inf")).max()
                raise GraphCheckError(
                    f"graph check failed: mode {self.mode}, graph {key}, first differing "
                    f"segment: {segment} (output {i}), max abs diff {diff:.3g}"
                )


def _cuda_graph() -> torch.cuda.CUDAGraph:
    try:
        return torch.cuda.CUDAGraph(keep_graph=True)
    except TypeError:  # older torch: no keep_graph, so no node counts
        return torch.cuda.CUDAGraph()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _reserved(device: torch.device) -> int:
    return torch.cuda.memory_reserved(device) if device.type == "cuda" else 0
