"""The graph runtime: every step of the model runs here, as a graph replay or eagerly.

The policy (``graphs.policy``) decides which graph a step replays; the runners capture and
replay it (``graphs.whole`` for ``full``/``ragged``, ``graphs.piecewise`` for the links);
all of them read the same persistent static buffers (``graphs.buffers``), and eager steps
that fit run on those buffers too. This module also keeps the statistics (hits per graph,
fallbacks and why, real against padded tokens, nodes, capture time and memory) and, every
``graph_check`` graph steps, re-runs a replayed step eagerly on the same padded batch and
demands bit-identical results.

With ``pad_to_agreed`` (data-parallel attention: the model's MLP collectives span the
data-parallel ranks) every rank's model must run the same token count every step: graph
steps replay the agreed tier anyway; eager steps pad to the agreed token count (the largest
rank's), and a rank with no work runs the padded step too, eagerly or as a graph replay.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from replaylm.batch import ForwardBatch, HostBatch, set_host_lengths, to_device
from replaylm.graphs.audit import AddressBook, AuditReport, audit_graphs, torch_segments
from replaylm.graphs.buffers import StaticBuffers
from replaylm.graphs.graph import Graph
from replaylm.graphs.piecewise import PiecewiseGraphs
from replaylm.graphs.policy import Dispatch, GraphPolicy
from replaylm.graphs.whole import WholeModelGraphs, run_whole_model, step_logits, step_tail
from replaylm.memory.arena import Arena
from replaylm.model.llama import CausalLM

log = logging.getLogger(__name__)

#: Data-parallel tier agreement: ``(num_tokens, num_reqs, uniform_decode, can_graph)`` of this
#: rank's step in, the values every rank agreed on out (max, max, min, min).
Agree = Callable[[int, int, bool, bool], tuple[int, int, bool, bool]]


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
    # "mode:tier" -> nodes of that whole-model graph's tail graph (``graphs.whole``), which a
    # step replays as well only when its masks are filled while its forward runs
    tail_nodes: dict[str, int] = field(default_factory=dict)
    # "mode:tier" -> streams the capture issued work on (1, or 2 with the model's side
    # stream) and the forks onto that side stream (one per sparse layer that forked)
    streams: dict[str, int] = field(default_factory=dict)
    forks: dict[str, int] = field(default_factory=dict)
    capture_seconds: float = 0.0
    graph_mib: float = 0.0
    checks: int = 0
    # Data-parallel tier agreement (zero on a single engine): steps agreed, seconds spent in
    # the agreement, tokens of padding it added (tier, or under data-parallel attention the
    # agreed eager size, beyond what this rank alone would have run), and dummy steps
    # ("mode:tier" -> steps; "eager" for padded eager steps) a rank with no work ran.
    agreement_steps: int = 0
    agreement_seconds: float = 0.0
    agreement_padded_tokens: int = 0
    dummy_steps: dict[str, int] = field(default_factory=dict)

    def fallback(self, reason: str) -> None:
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1

    def as_dict(self) -> dict:
        return {
            "hits": dict(self.hits), "fallbacks": dict(self.fallbacks),
            "real_tokens": self.real_tokens, "padded_tokens": self.padded_tokens,
            "padding_share": round(1 - self.real_tokens / self.padded_tokens, 4)
            if self.padded_tokens else 0.0,
            "num_graphs": self.num_graphs, "nodes": dict(self.nodes),
            "tail_nodes": dict(self.tail_nodes),
            "streams": dict(self.streams), "forks": dict(self.forks),
            "capture_seconds": round(self.capture_seconds, 3),
            "graph_mib": round(self.graph_mib, 1), "checks": self.checks,
            "agreement_steps": self.agreement_steps,
            "agreement_seconds": round(self.agreement_seconds, 6),
            "agreement_padded_tokens": self.agreement_padded_tokens,
            "dummy_steps": dict(self.dummy_steps),
        }


@dataclass
class StepResult:
    logits: torch.Tensor  # [L_real, V]
    # [L_real] the tail's samples (``whole.step_tail``), already in last_token (None: not run)
    samples: torch.Tensor | None
    batch: ForwardBatch  # the sampling rows live in batch.sample_* [:L_real]
    dispatch: Dispatch
    padded_tokens: int


class GraphRuntime:
    """Runs every step: dispatches it (``policy``) to a graph or eagerly, on the persistent
    buffers."""

    def __init__(self, model: CausalLM, policy: GraphPolicy, device: torch.device, *,
                 max_num_seqs: int, max_blocks: int, max_model_len: int,
                 host_attn_lengths: bool, eager_tokens: int, graph_check: int = 0,
                 rows_per_req: int = 1, pad_to_agreed: bool = False,
                 split_tails: bool = True) -> None:
        self.model, self.policy, self.device = model, policy, device
        self.mode = policy.mode
        self.pad_to_agreed = pad_to_agreed
        self.host_attn_lengths = host_attn_lengths
        self.graph_check = graph_check
        self.stats = GraphStats()
        self.graph_steps = 0
        top = policy.top_tier
        # Eager steps up to ``eager_tokens`` also run on the static buffers (one copy in).
        top_tokens = max(top, eager_tokens)
        # ``rows_per_req``: sampled rows a request may have in one step (k + 1 to verify k
        # drafts); the logits rows are sized by it, up to the token count.
        self.buffers = StaticBuffers(top_tokens, min(top_tokens, max_num_seqs), max_num_seqs,
                                     max_blocks, device, max_model_len,
                                     max_logits=min(top_tokens, max_num_seqs * rows_per_req),
                                     vocab_size=model.cfg.vocab_size)
        self.last_token = self.buffers.last_token
        # ``split_tails``: a tail graph per whole-model tier, for steps run in two halves
        # (``run``'s ``between``); a runner that never gets one (a draft model's) has none.
        self.split_tails = split_tails
        self.whole = (WholeModelGraphs(model, self.buffers, max_num_seqs, top)
                      if policy.uses_whole else None)
        self.piecewise = (PiecewiseGraphs(model, self.buffers, top, host_attn_lengths)
                          if policy.uses_piecewise else None)
        # The torch allocator's segments and the arena chunks mapped right after capture:
        # what the pointer audit knows.
        self.capture_segments: list[tuple[int, int]] = []
        self.capture_chunks: list[tuple[int, int]] | None = None

    @staticmethod
    def estimate_static_bytes(policy: GraphPolicy, *, vocab_size: int, q_size: int,
                              dtype: torch.dtype, max_num_seqs: int,
                              rows_per_req: int = 1) -> int:
        """Static memory the runners will add for ``policy`` (reserved before the KV pool is
        sized, with the graphs' activation pool)."""
        top, total = policy.top_tier, 0
        if policy.uses_whole:
            total += WholeModelGraphs.static_bytes(vocab_size, top, max_num_seqs * rows_per_req)
        if policy.uses_piecewise:
            total += PiecewiseGraphs.static_bytes(q_size, top, dtype)
        return total

    # Capture -----------------------------------------------------------------------------

    def capture(self, arena: Arena | None = None) -> None:
        """Capture every graph of the policy; ``arena``: the engine's address-stable regions
        (``memory.arena``), whose mapped chunks the pointer audit then knows as captured."""
        jobs = self.policy.capture_order()
        if not jobs:
            return
        pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        getters = self.buffers.getters()
        for runner in (self.whole, self.piecewise):
            if runner is not None:
                getters |= runner.getters()

        def new_graph(name: str) -> Graph:
            return Graph(name, self.device, pool, getters)

        if self.device.type == "cuda":
            # Cached free blocks would be handed back under memory pressure during capture and
            # make the graphs' memory read low (even negative): start from a trimmed cache.
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        before = _reserved(self.device)
        start = time.perf_counter()
        with torch.inference_mode():
            for mode, tier in tqdm(jobs, desc=f"capturing {self.mode} graphs", unit="graph",
                                   disable=len(jobs) < 2):
                self.buffers.fill_padding()
                forks = self.model.side_stream_forks()
                if mode == "piecewise":
                    nodes = self.piecewise.capture(tier, new_graph)
                else:
                    tail_graph = new_graph(f"{mode}:{tier}:tail") if self.split_tails else None
                    nodes, tail = self.whole.capture(mode, tier, new_graph(f"{mode}:{tier}"),
                                                     tail_graph)
                    if tail is not None:
                        self.stats.tail_nodes[f"{mode}:{tier}"] = tail
                if nodes is not None:
                    self.stats.nodes[f"{mode}:{tier}"] = nodes
                forks = self.model.side_stream_forks() - forks
                self.stats.forks[f"{mode}:{tier}"] = forks
                self.stats.streams[f"{mode}:{tier}"] = 1 + (forks > 0)  # one side stream
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.capture_segments = torch_segments(self.device)
        if arena is not None:
            self.capture_chunks = arena.mapped_ranges()
        s = self.stats
        s.capture_seconds = time.perf_counter() - start
        s.num_graphs = len(self.captured())
        s.graph_mib = (_reserved(self.device) - before) / 2**20
        log.info("captured %d graphs (modes %s) in %.2f s, %.1f MiB", s.num_graphs,
                 ",".join(sorted({m for m, _ in jobs})), s.capture_seconds, s.graph_mib)

    def captured(self) -> list[Graph]:
        """Every captured graph (whole-model graphs, their tail graphs, then each tier's
        links)."""
        out = [*self.whole.graphs.values(), *self.whole.tails.values()] if self.whole else []
        if self.piecewise:
            out += [g for links in self.piecewise.links.values() for g in links]
        return out

    def audit(self, arena: Arena | None = None) -> AuditReport:
        """The pointer audit of every captured graph (``graphs.audit``): raises
        ``GraphAuditError`` if one holds an address of unmapped or freed memory; ``arena``:
        the engine's address-stable regions (``memory.arena``), if any."""
        live = torch_segments(self.device) if self.device.type == "cuda" else []
        book = AddressBook(arena, self.capture_segments, live, self.capture_chunks)
        return audit_graphs(self.captured(), book)

    # Steps -------------------------------------------------------------------------------

    def dispatch(self, num_tokens: int, num_reqs: int, uniform_decode: bool,
                 can_graph: bool = True, agree: Agree | None = None) -> Dispatch:
        """The policy's dispatch of this step; with ``agree`` (data parallel), of the values
        every rank agreed on, so all ranks run the same mode and tier. ``can_graph=False``
        (a step that must run eagerly) makes every rank run eagerly; with ``pad_to_agreed``
        an eager step's ``pad_to`` is the agreed token count."""
        if agree is None:
            return self.policy.dispatch(num_tokens, num_reqs, uniform_decode)
        s = self.stats
        t0 = time.perf_counter()
        tokens, reqs, uniform, graphable = agree(num_tokens, num_reqs, uniform_decode, can_graph)
        s.agreement_seconds += time.perf_counter() - t0
        s.agreement_steps += 1
        if tokens == 0:
            return Dispatch("eager")  # no rank has work
        d = (self.policy.dispatch(tokens, reqs, uniform) if graphable else
             Dispatch("eager", reason="a data-parallel rank runs this step eagerly"))
        if not d.graphed and self.pad_to_agreed:
            if num_tokens:
                s.agreement_padded_tokens += tokens - num_tokens
            return dataclasses.replace(d, pad_to=tokens)
        if d.graphed and num_tokens:
            own = self.policy.dispatch(num_tokens, num_reqs, uniform_decode)
            s.agreement_padded_tokens += max(0, d.tier - (own.tier if own.graphed else num_tokens))
        return d

    def run_idle(self, agree: Agree) -> Dispatch:
        """A data-parallel rank with no work: agree with the others and, when they replay a
        graph, replay the same graph on an all-padding batch (graph-checked on the same steps
        as theirs). An eager step needs nothing from this rank unless it is padded
        (``pad_to_agreed``): then it runs the agreed size eagerly, all padding."""
        d = self.dispatch(0, 0, True, True, agree)
        s = self.stats
        if d.pad_to:
            s.dummy_steps["eager"] = s.dummy_steps.get("eager", 0) + 1
            s.agreement_padded_tokens += d.pad_to
            host = HostBatch.empty().padded(d.pad_to, self.buffers.scratch_slot)
            run_whole_model(self.model, self.buffers, self.eager_batch(host))
            return d
        if not d.graphed:
            return d
        key = f"{d.mode}:{d.tier}"
        s.dummy_steps[key] = s.dummy_steps.get(key, 0) + 1
        s.agreement_padded_tokens += d.tier
        check = self._check_label(key)
        host = HostBatch.empty()
        if d.mode == "piecewise":
            self.piecewise.run(host, d.tier, check)
        else:
            self.whole.run(host, d.mode, d.tier, check)
        return d

    def _check_label(self, key: str) -> str | None:
        """Count a graph step (every rank counts the same steps, busy or idle, so under data
        parallelism all ranks check the same ones); the check's label when this one is due."""
        self.graph_steps += 1
        if self.graph_check > 0 and self.graph_steps % self.graph_check == 0:
            self.stats.checks += 1
            return f"mode {self.mode}, graph {key}"
        return None

    def run(self, host: HostBatch, agree: Agree | None = None,
            eager_reason: str | None = None, between: Callable[[], None] | None = None
            ) -> StepResult:
        """Run one step; ``eager_reason``: the step must run without a graph, and why.

        ``between``: called once the step's forward is launched and before its tail (the
        masks and the samples, ``graphs.whole``) is, so the tail reads what it wrote
        (``structured.masks``: a constrained step's masks); the device runs the forward
        meanwhile. Without it no sampled row is constrained, so the step needs no masks:
        whole-model graphs take the samples inside the step graph."""
        if eager_reason is not None and agree is None:
            d = Dispatch("eager", reason=eager_reason)
        else:
            d = self.dispatch(host.num_tokens, host.num_reqs, host.is_uniform_decode,
                              eager_reason is None, agree)
        s = self.stats
        n = host.num_sampled
        if not d.graphed:
            if d.reason:
                s.fallback(d.reason)
            if d.pad_to:
                host = host.padded(d.pad_to, self.buffers.scratch_slot)
            batch = self.eager_batch(host)
            logits = step_logits(self.model, self.buffers, batch)
            if between is not None:
                between()
            samples = step_tail(self.buffers, logits, batch, masks=self.buffers.bitmask_any)
            return StepResult(logits, samples, batch, d, host.num_tokens)
        key = f"{d.mode}:{d.tier}"
        s.hits[key] = s.hits.get(key, 0) + 1
        s.real_tokens += host.num_tokens - host.layout_pad_tokens
        s.padded_tokens += d.tier
        check = self._check_label(key)
        split = None
        if between is not None:
            def split(logits: torch.Tensor) -> None:  # before the tail masks any row
                self._check_padding(logits[:n], key)
                between()
        if d.mode == "piecewise":
            logits, batch = self.piecewise.run(host, d.tier, check)
            if split is not None:
                split(logits)
            # eager, after the piecewise graphs
            samples = step_tail(self.buffers, logits, batch, masks=self.buffers.bitmask_any)
        else:
            logits, samples, batch = self.whole.run(host, d.mode, d.tier, check, split)
        if split is None:  # the engine splits every step with a constrained row: none here
            self._check_padding(logits[:n], key)
        return StepResult(logits[:n], samples[:n], batch, d, d.tier)

    def _check_padding(self, logits: torch.Tensor, key: str) -> None:
        """With ``poison_padding``: raise if a real row's logits are not all finite (read
        before the masks, whose ``-inf`` are not a leak)."""
        if self.model.poison_padding and len(logits) and not bool(torch.isfinite(logits).all()):
            # A debugging mode, so this host sync is acceptable; it runs after the replay.
            raise PaddingLeakError(f"padding leaked into real rows: mode {self.mode}, graph {key}")

    def eager_batch(self, host: HostBatch) -> ForwardBatch:
        """An unpadded eager step: on the static buffers when it fits, else fresh tensors."""
        b = self.buffers
        if not b.fits(host):
            return to_device(host, self.last_token, b.slot_tables, self.device,
                             self.host_attn_lengths)
        b.load(host, host.num_tokens, host.num_reqs, host.num_sampled)
        batch = b.view(host.num_tokens, host.num_reqs, host.num_sampled, host.max_q_len,
                       max_kv_len=int(host.kv_lens.max()))
        if self.host_attn_lengths:  # eager attention may read host lengths (torch reference)
            set_host_lengths(batch.meta, host)
        return batch


def _reserved(device: torch.device) -> int:
    return torch.cuda.memory_reserved(device) if device.type == "cuda" else 0
