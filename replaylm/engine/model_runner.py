"""The model runner: owns the model, the KV pool and the per-slot device state; runs steps."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from replaylm.attention.backend import AttentionBackend
from replaylm.attention.torch_dense import TorchDenseAttentionBackend
from replaylm.attention.torch_ref import TorchAttentionBackend
from replaylm.batch import BLOCK_SIZE, AttentionMetadata, HostBatch, to_device
from replaylm.config import EngineArgs
from replaylm.engine.packing import build_host_batch
from replaylm.engine.prompt_logprobs import plan_prompt_logprobs
from replaylm.engine.request import Request
from replaylm.engine.scheduler import SchedulerOutput
from replaylm.graphs.policy import Dispatch, GraphPolicy, attention_backend_name, resolve_mode
from replaylm.graphs.runtime import Agree, GraphRuntime
from replaylm.kernels import compile_plan, jit_clock
from replaylm.model.config import ModelConfig
from replaylm.model.llama import CausalLM
from replaylm.model.loader import load_model
from replaylm.model.parallel import (
    DataParallelAttention,
    TensorParallel,
    dp_attention_config,
    shard_config,
)
from replaylm.sampling.sampler import sample
from replaylm.sampling.step import PendingStep, PromptLogprobPlan, StepSampler
from replaylm.speculative.acceptance import emitted_rows
from replaylm.speculative.config import SpecConfig

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"EngineArgs.device={name!r} but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def make_attention_backend(requested: str, device: torch.device, mode: str) -> AttentionBackend:
    """The attention backend for ``mode`` (``graphs.policy.attention_backend_name``)."""
    triton_backend = None
    if requested == "triton" or (requested == "auto" and device.type == "cuda"):
        try:
            from replaylm.attention.triton_backend import TritonAttentionBackend as triton_backend
        except ImportError as e:
            log.debug("Triton attention does not import: %s", e)
    name = attention_backend_name(requested, device.type, mode, triton_backend is not None)
    if name == "triton":
        return triton_backend()
    return TorchDenseAttentionBackend() if name == "torch_dense" else TorchAttentionBackend()


@dataclass
class StepInput:
    """One step as a tensor-parallel leader sends it to the other ranks of its group: the
    host batch (a verify's layout included: drafts, ``draft_next`` / ``seg_start``, padding
    rows, penalty rows), the sampling settings of newly slotted requests, the prompt-logprob
    rows (host tensors, without the requests), and whether the leader's drafter replaces
    verify samples (``accept_from_leader``: the ranks then take the leader's tokens)."""

    host: HostBatch
    admitted: list[SimpleNamespace]
    plan: PromptLogprobPlan | None
    accept_from_leader: bool = False

    @staticmethod
    def of(out: SchedulerOutput, host: HostBatch, accept_from_leader: bool = False
           ) -> StepInput:
        admitted = [SimpleNamespace(slot=r.slot, sampling_params=r.sampling_params, seed=r.seed,
                                    prompt_token_ids=r.prompt_token_ids,
                                    output_token_ids=r.output_token_ids,
                                    eos_token_ids=r.eos_token_ids)
                    for r in out.newly_slotted]
        plan = _prompt_plan(out, host, torch.device("cpu"))
        if plan is not None:
            plan = dataclasses.replace(plan, spans=[])
        return StepInput(host, admitted, plan, accept_from_leader)


#: A verify's acceptance rule: (processed logits, sampled tokens) -> the tokens kept.
Accept = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _sent_to_group(accept: Accept, tp: TensorParallel) -> Accept:
    """The leader's ``accept``, its kept tokens then broadcast to the tensor-parallel group."""
    return lambda logits, tokens: tp.broadcast(accept(logits, tokens).contiguous())


def _from_leader(tp: TensorParallel) -> Accept:
    """A follower's acceptance: the tokens the leader's rule kept (``_sent_to_group``)."""
    return lambda logits, tokens: tp.broadcast(torch.empty_like(tokens))


def _prompt_plan(out: SchedulerOutput, host: HostBatch, device: torch.device
                 ) -> PromptLogprobPlan | None:
    """The step's prompt-logprob rows; the padded verify layout shifts them
    (``host.cu_seqlens_q``)."""
    return plan_prompt_logprobs(out, device,
                                host.cu_seqlens_q if host.layout_pad_tokens else None)


class ModelRunner:
    """Owns one model, its KV pool, its graphs and the per-slot sampling state; runs steps.

    ``kv_partner``: a second pool sized with this one (a draft model's,
    ``engine.draft_model``): its ``partner_block_bytes`` are added to each of this pool's
    blocks and its ``partner_fixed_bytes`` reserved, before the KV pool is sized.
    ``verify_accept``: set by the engine when a drafter's proposals carry a distribution;
    it turns a verify step into that drafter's acceptance rule (``StepSampler.run``). Under
    tensor parallel the drafter lives on the leader alone: the leader applies the rule and
    broadcasts the kept tokens to the group, so every rank's ``last_token`` and penalty
    counts stay the same.

    With ``tp`` (tensor parallel) it holds one rank's shard (``cfg`` is then the shard's
    shapes) and every rank of the group runs the same steps: the leader's ``execute`` hands
    each step's ``StepInput`` to ``broadcast`` (set by ``replaylm.distributed``), and the
    other ranks run it with ``run_step``. Sampling is replicated: every rank holds the full
    logits and the same per-slot state, so every rank samples the same tokens.

    With ``dp`` (data-parallel attention) it holds every head and one rank's slice of the
    MLP, whose collectives span the data-parallel ranks: its steps run in the token count the
    ranks agreed on (``GraphRuntime``'s ``pad_to_agreed``), idle or not.
    """

    def __init__(self, args: EngineArgs, cfg: ModelConfig, model_dir: Path | None,
                 max_model_len: int, tp: TensorParallel | None = None,
                 kv_partner: Any = None, dp: DataParallelAttention | None = None) -> None:
        self._setup(args, cfg, max_model_len, tp, dp)
        self.spec = (SpecConfig.from_dict(args.speculative_config)
                     if args.speculative_config is not None else None)
        if self.spec is not None:
            # Verify steps run through the token tiers (``full`` graphs serve only uniform
            # decode: its verifies run eagerly, bounded by the step budget alone).
            self.spec.check_fits(args.max_num_batched_tokens,
                                 max(self.policy.token_tiers, default=0))
        # Sampled rows per request in one step: k + 1 when verifying k drafts.
        self.rows_per_req = 1 + (self.spec.num_speculative_tokens if self.spec else 0)
        self.verify_accept: Callable[[SchedulerOutput, Any], Any] | None = None
        self.kv_partner = kv_partner
        self.attn = make_attention_backend(args.attention_backend, self.device, self.graph_mode)
        self.pdl = self._configure_pdl()
        self._load(model_dir)
        self.compile_plan = self._compile_ahead()
        self.all_reduce_report = self._configure_all_reduce()
        self.sampler = StepSampler(args.max_num_seqs, self.cfg.vocab_size, self.device,
                                   max_rows=args.max_num_seqs * self.rows_per_req)
        t0 = time.perf_counter()
        self.num_blocks = self._decide_num_blocks()
        if tp is not None:  # the leader's block ids index every rank's pool
            self.num_blocks = tp.min_int(self.num_blocks)
        self.kv_caches = self._allocate_kv(self.num_blocks)
        self.kv_sizing_seconds = time.perf_counter() - t0  # the profiling forward included
        self._warm_sampler()
        self._start_graphs()
        self._save_compile_plan()

    def _setup(self, args: EngineArgs, cfg: ModelConfig, max_model_len: int,
               tp: TensorParallel | None = None, dp: DataParallelAttention | None = None
               ) -> None:
        """Device, dtype, graph mode and tiers from the settings; under tensor parallel or
        data-parallel attention, ``cfg`` becomes this rank's shard (``full_cfg`` keeps the
        whole model's)."""
        self.args = args
        self.tp = tp
        self.dp = dp
        # Tensor parallel leader: sends each step's input to the other ranks of its group.
        self.broadcast: Callable[[tuple], None] | None = None
        self.full_cfg = cfg
        self.cfg = shard_config(cfg, self.tp.size) if self.tp is not None else cfg
        if dp is not None:
            self.cfg = dp_attention_config(cfg, dp.size)
        self.device = resolve_device(args.device)
        self.dtype = resolve_dtype(args.dtype, self.device)
        self._jit_snapshot()  # on CUDA: count Triton's compiles from here (start-up split)
        if self.device.type == "cuda":
            compile_plan.install()  # note the kernel variants this start compiles
        self.graph_mode = resolve_mode(args.cuda_graph_mode, args.enforce_eager, self.device.type)
        self.policy = GraphPolicy.resolve(
            self.graph_mode, graph_tiers=args.graph_tiers, max_graph_tokens=args.max_graph_tokens,
            max_graphs=args.max_graphs, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            speculative=args.speculative_config is not None)
        self.max_model_len = max_model_len
        self.max_blocks_per_req = -(-max_model_len // BLOCK_SIZE)

    def _load(self, model_dir: Path | None) -> None:
        """The model's weights and kernel settings (the attention backend chosen first)."""
        args, cfg = self.args, self.cfg
        t0 = time.perf_counter()
        self.model: CausalLM = load_model(
            cfg, model_dir, args.load_format, self.dtype, self.device, args.seed, self.tp,
            self.full_cfg, self.dp)
        self.load_seconds = time.perf_counter() - t0
        self.model.poison_padding = args.poison_padding
        self.model.use_side_stream(args.moe_side_stream_max_tokens)
        # Fused Triton kernels for the dense links go with the Triton attention backend.
        self.model.use_fused_kernels(args.fused_kernels and self.attn.name == "triton")
        self.model.rope_in_attention_max_reqs = (
            self.policy.rope_in_attention_max_reqs(args.rope_in_attention_max_reqs)
            if self.model.kernels is not None else 0)

    def _configure_all_reduce(self) -> dict | None:
        """Under tensor parallel, decide how the group sums (``EngineArgs.all_reduce_backend``,
        ``model.allreduce``: measured now, before KV sizing and capture); the report, or None
        without a group."""
        tp = self.tp
        if tp is None or tp.size == 1 or tp.group is None:
            return None
        report = tp.reducer.configure(self.args.all_reduce_backend, tp.group,
                                      self.cfg.hidden_size, self.dtype, self.device)
        if tp.rank == 0:
            log.info("tensor-parallel all-reduce (%s): %s; %s; latency (us) by tokens: %s",
                     report["setting"], report["summary"], report["reason"],
                     report["latency_us"] or "not measured")
        return report

    def _start_graphs(self) -> None:
        """Bind the model to its KV pool, build the graph runtime and capture its graphs."""
        args, cfg = self.args, self.cfg
        self.model.bind(self.attn, self.kv_caches, self.max_model_len)
        if self.device.type == "cuda":
            self.attn.warmup(num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                             head_dim=cfg.head_dim, dtype=self.dtype, device=self.device,
                             rope=self.model.rope_in_attention_max_reqs > 0, qk_norm=cfg.qk_norm)
        self.graphs = GraphRuntime(
            self.model, self.policy, self.device, max_num_seqs=args.max_num_seqs,
            max_blocks=self.max_blocks_per_req, max_model_len=self.max_model_len,
            host_attn_lengths=not self.attn.graph_safe,
            eager_tokens=min(args.max_graph_tokens, args.max_num_batched_tokens),
            graph_check=args.graph_check, rows_per_req=self.rows_per_req,
            pad_to_agreed=self.dp is not None,
        )
        self.buffers = self.graphs.buffers
        self.last_token = self.buffers.last_token  # [S+1]: each slot's newest sample
        self.layout_pad_tokens = 0  # padded verify layout: the latest step's padding rows
        self.tune_seconds = self._tune_kernels()
        jit_before = self._jit_snapshot()
        self.graphs.capture()
        self.capture_jit = self._jit_snapshot().since(jit_before)

    def _plan_key(self) -> str:
        return compile_plan.plan_key(torch.cuda.get_device_name(self.device),
                                     dataclasses.asdict(self.cfg), dataclasses.asdict(self.args),
                                     self.graph_mode)

    def _compile_ahead(self) -> compile_plan.PreloadStats | None:
        """On CUDA with ``EngineArgs.compile_ahead``: compile, on a thread pool, the kernel
        variants an earlier start with these shapes and settings compiled (``kernels.
        compile_plan``), before anything launches them; None otherwise."""
        if self.device.type != "cuda" or not self.args.compile_ahead:
            return None
        from replaylm.kernels import tuner

        entries, source = compile_plan.read(self._plan_key())
        if not entries:
            return None
        threads = tuner.compile_threads(self.args.tuning_compile_threads)
        try:
            stats = compile_plan.preload(entries, threads)
        except Exception as e:  # noqa: BLE001 - without the plan the launches compile as usual
            log.warning("compile plan %s not preloaded: %s", source, e)
            return None
        stats.source = str(source)
        log.info("compile plan %s: %d kernels compiled ahead on %d threads in %.2f s "
                 "(%d skipped, %d refused)", source, stats.submitted, threads, stats.seconds,
                 stats.skipped, stats.refused)
        return stats

    def _save_compile_plan(self) -> None:
        """Write the kernel variants this start compiled as its compile plan (on CUDA)."""
        if self.device.type != "cuda" or not self.args.compile_ahead:
            return
        try:
            compile_plan.save(self._plan_key())
        except OSError as e:  # a read-only cache directory: the next start compiles as usual
            log.warning("compile plan not saved: %s", e)

    def _configure_pdl(self) -> bool:
        """Apply ``EngineArgs.pdl`` to the Triton kernels (process-wide); returns whether
        they launch with PDL."""
        if self.attn.name != "triton":
            if self.args.pdl == "on":
                raise ValueError("EngineArgs.pdl='on' needs the Triton kernels (CUDA with "
                                 "attention_backend triton or auto)")
            return False
        from replaylm.kernels import pdl

        return pdl.configure(self.args.pdl)

    def _tune_kernels(self) -> float:
        """Decide the projections' kernels (``kernels.tuner``) at every row count a graph
        tier can run them with, before capture, so capture time is capture alone: the model
        runs each of its dense calls at that size (``tuner.decide_all``: the kernels the
        decisions need compile ahead on a thread pool, then what neither the user's cache
        nor the shipped table decides is timed). Sets ``tuning`` (``TuningStats``) and
        ``tune_jit``; returns the seconds spent."""
        self.tuning = None
        self.tune_jit = jit_clock.JitTotals()
        if self.model.kernels is None:
            return 0.0
        from replaylm.kernels import tuner
        from replaylm.kernels.skinny import MAX_M

        jit_before, stats_before = self._jit_snapshot(), tuner.STATS.copy()
        start = time.perf_counter()
        tuner.configure(shipped_table=self.args.shipped_tuning_table)
        tiers = self.policy.decode_tiers + self.policy.token_tiers
        sizes = sorted({t for t in tiers if t <= MAX_M} | {1})
        threads = tuner.compile_threads(self.args.tuning_compile_threads)
        tuner.decide_all(lambda: [self.model.run_dense_calls(m) for m in sizes], threads)
        seconds = time.perf_counter() - start
        self.tuning = tuner.STATS.since(stats_before)
        self.tune_jit = self._jit_snapshot().since(jit_before)
        log.info("projection kernels for %d row counts in %.2f s: decisions %s; %d kernels "
                 "compiled ahead on %d threads in %.2f s, %d candidates timed in %.2f s",
                 len(sizes), seconds, dict(self.tuning.sources), self.tuning.precompiled,
                 threads, self.tuning.precompile_s, self.tuning.candidates_timed,
                 self.tuning.timing_s)
        return seconds

    def _jit_snapshot(self) -> jit_clock.JitTotals:
        """Triton compile totals so far (``kernels.jit_clock``; counted on CUDA only)."""
        if self.device.type == "cuda":
            jit_clock.install()
        return jit_clock.snapshot()

    def _warm_sampler(self) -> None:
        """Build the sampler's cached tables now, not inside a step that may be captured."""
        logits = torch.zeros(1, self.cfg.vocab_size, device=self.device)
        zeros = torch.zeros(1, dtype=torch.int64, device=self.device)
        sample(logits, zeros, zeros, self.sampler.state, all_greedy=False, need_filter=True)

    # KV pool -------------------------------------------------------------------------------

    @property
    def block_bytes(self) -> int:
        return self.cfg.kv_bytes_per_token(self.dtype) * BLOCK_SIZE

    def _allocate_kv(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        shape = (self.cfg.num_layers, 2, num_blocks, BLOCK_SIZE, self.cfg.num_kv_heads,
                 self.cfg.head_dim)
        pool = torch.zeros(shape, dtype=self.dtype, device=self.device)
        return [(pool[i, 0], pool[i, 1]) for i in range(self.cfg.num_layers)]

    def _decide_num_blocks(self) -> int:
        args = self.args
        # More blocks than every slot at full length could ever hold are never used.
        useful = args.max_num_seqs * self.max_blocks_per_req + 1
        if args.num_kv_blocks is not None:
            return args.num_kv_blocks
        partner = self.kv_partner
        per_block = self.block_bytes + (partner.partner_block_bytes if partner else 0)
        fixed = partner.partner_fixed_bytes if partner else 0
        if self.device.type != "cuda":
            return max(2, min(useful, (int(args.cpu_kv_cache_gib * 2**30) - fixed) // per_block))
        peak = self._profile_activation_peak()
        free, total = torch.cuda.mem_get_info(self.device)
        torch_reserved = torch.cuda.memory_reserved(self.device)
        not_ours = total - free - torch_reserved
        weights = torch.cuda.memory_allocated(self.device)
        graphs = self._estimate_graph_bytes(peak)
        budget = total * args.gpu_memory_utilization - not_ours - weights - peak - graphs - fixed
        blocks = int(budget // per_block)
        log.info("KV sizing: total %.1f GiB, weights %.2f GiB, activation peak %.2f GiB, "
                 "graphs (estimate) %.2f GiB, other %.2f GiB, partner pool %.2f GiB + %d B per "
                 "block -> %d blocks", total / 2**30, weights / 2**30, peak / 2**30,
                 graphs / 2**30, not_ours / 2**30, fixed / 2**30, per_block - self.block_bytes,
                 blocks)
        if blocks < 2:
            raise ValueError(
                f"no GPU memory left for the KV cache (weights {weights / 2**30:.2f} GiB, "
                f"activation peak {peak / 2**30:.2f} GiB): raise gpu_memory_utilization or "
                "lower max_num_batched_tokens"
            )
        return min(blocks, useful)

    def _estimate_graph_bytes(self, profile_peak: int) -> int:
        """Memory the graphs will hold, reserved before the KV pool is sized.

        Graphs share one pool, captured largest first, so it holds about one activation peak
        of the top tier (scaled from the profiling run), plus the runners' static buffers.
        """
        top = self.policy.top_tier
        if top == 0:
            return 0
        profiled = min(self.args.max_num_batched_tokens, self.max_model_len)
        acts = profile_peak * min(1.0, top / profiled)
        static = GraphRuntime.estimate_static_bytes(
            self.policy, vocab_size=self.cfg.vocab_size, q_size=self.cfg.q_size,
            dtype=self.dtype, max_num_seqs=self.args.max_num_seqs,
            rows_per_req=self.rows_per_req)
        return int(acts + static + 64 * 2**20)

    @torch.inference_mode()
    def _profile_activation_peak(self) -> int:
        """Run the largest step once on a throwaway cache; return its activation peak in bytes."""
        n = min(self.args.max_num_batched_tokens, self.max_model_len)
        blocks = -(-n // BLOCK_SIZE) + 1
        caches = self._allocate_kv(blocks)
        self.model.bind(self.attn, caches, self.max_model_len)
        torch.cuda.synchronize(self.device)
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        meta = AttentionMetadata(
            cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=self.device),
            kv_lens=torch.tensor([n], dtype=torch.int32, device=self.device),
            block_table=torch.arange(1, blocks, dtype=torch.int32, device=self.device)[None],
            slot_mapping=torch.arange(BLOCK_SIZE, BLOCK_SIZE + n, device=self.device),
            num_tokens=n, num_reqs=1, max_q_len=n, max_kv_len=n,
            cu_seqlens_q_cpu=[0, n], kv_lens_cpu=[n],
        )
        ids = torch.zeros(n, dtype=torch.int64, device=self.device)
        pos = torch.arange(n, device=self.device)
        hidden = self.model(ids, pos, meta)
        self.model.compute_logits(hidden[-min(n, self.args.max_num_seqs * self.rows_per_req):])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        del caches, hidden
        torch.cuda.empty_cache()
        return peak

    # Steps ---------------------------------------------------------------------------------

    def admit(self, req: Request) -> None:
        """Write a newly slotted request's sampling settings into its slot."""
        self.sampler.admit(req)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, on_launch: Callable[[], None] | None = None,
                agree: Agree | None = None) -> tuple[PendingStep | None, Dispatch, int]:
        """Launch one step; returns the pending samples, the dispatch and the padded size.
        ``agree``: data-parallel tier agreement (``GraphRuntime.dispatch``).

        Nothing here waits for the device: the samples are read later, from the
        ``PendingStep``. ``on_launch`` runs after the host-only work, right before the step's
        first device operation (the profiler's start event).
        """
        spec = self.spec
        pad_to = spec.num_speculative_tokens + 1 if spec and spec.verify == "padded" else 0
        host = build_host_batch(out, self.max_blocks_per_req, pad_to, self.max_model_len)
        self.layout_pad_tokens = host.layout_pad_tokens  # the latest step's (spec stats)
        if on_launch is not None:
            on_launch()
        # A drafter's acceptance rule reads the schedule alone (a verifying request was
        # slotted in an earlier step), so it is known before the step goes out.
        accept = None
        if host.draft_next is not None and self.verify_accept is not None:
            accept = self.verify_accept(out, self.sampler.state)
        if self.broadcast is None:
            return self._launch(host, out.newly_slotted, _prompt_plan(out, host, self.device),
                                agree, accept)
        step = StepInput.of(out, host, accept is not None)
        self.broadcast(("step", step))
        plan = step.plan
        if plan is not None:  # the leader's plan keeps the requests (its output spans)
            plan = _prompt_plan(out, host, self.device)
        if accept is not None:
            accept = _sent_to_group(accept, self.tp)  # type: ignore[arg-type]
        return self._launch(host, out.newly_slotted, plan, agree, accept)

    @torch.inference_mode()
    def run_step(self, step: StepInput, agree: Agree | None = None
                 ) -> tuple[PendingStep | None, Dispatch, int]:
        """A tensor-parallel rank's part of the step its leader launched (``execute``)."""
        plan = step.plan
        if plan is not None:
            plan = dataclasses.replace(plan, rows=plan.rows.to(self.device),
                                       targets=plan.targets.to(self.device))
        accept = _from_leader(self.tp) if step.accept_from_leader else None  # type: ignore[arg-type]
        return self._launch(step.host, step.admitted, plan, agree, accept)

    def _launch(self, host: HostBatch, admitted: list, plan: PromptLogprobPlan | None,
                agree: Agree | None, accept: Accept | None = None,
                ) -> tuple[PendingStep | None, Dispatch, int]:
        """The device part of a step (``accept``: a verify's acceptance rule beyond exact
        matching, ``StepSampler.run``)."""
        for req in admitted:
            self.admit(req)
        self.sampler.flush()
        self.buffers.update_block_tables(host)
        spec = self.spec
        if plan is None:
            eager = (spec is not None and spec.verify == "eager" and host.draft_next is not None
                     and self.policy.mode != "eager")
            res = self.graphs.run(host, agree, "speculative_config verify=eager" if eager else None)
            logits, greedy, batch = res.logits, res.greedy, res.batch
            dispatch, padded = res.dispatch, res.padded_tokens
        else:
            pad_to = 0
            if agree is not None:  # the other ranks run this step eagerly too
                pad_to = self.graphs.dispatch(host.num_tokens, host.num_reqs,
                                              host.is_uniform_decode, False, agree).pad_to
            logits, batch, dispatch, padded = self._run_with_prompt_rows(host, plan, pad_to)
            greedy = None
        n = host.num_sampled
        if n == 0 and plan is None:
            return None, dispatch, padded
        slots = batch.sample_slots[:n]
        # Penalties, logit_bias, min_p, min_tokens and logprobs (when asked) then sampling.
        host_view = None
        if host.draft_next is not None:  # a verify: rows past a rejected draft read -1
            draft_next = torch.from_numpy(host.draft_next).to(self.device, non_blocking=True)
            seg_start = torch.from_numpy(host.seg_start).to(self.device, non_blocking=True)

            def host_view(tokens: torch.Tensor) -> torch.Tensor:
                return torch.where(emitted_rows(tokens, draft_next, seg_start), tokens, -1)
        draft_counts = None
        if host.draft_count_rows is not None:  # penalties see the drafts before each row
            draft_counts = (
                torch.from_numpy(host.draft_count_rows).to(self.device, non_blocking=True),
                torch.from_numpy(host.draft_count_tokens).to(self.device, non_blocking=True))
        pending = self.sampler.run(logits, slots, batch.sample_out_pos[:n],
                                   host.sample_slots.tolist(), plan, greedy, host_view,
                                   draft_counts, accept)
        if pending.device_tokens is not greedy:
            self.last_token.index_copy_(0, slots, pending.device_tokens)
        return pending, dispatch, padded

    @torch.inference_mode()
    def idle(self, agree: Agree) -> Dispatch:
        """A data-parallel step with no work on this rank (``GraphRuntime.run_idle``)."""
        if self.broadcast is not None:
            self.broadcast(("idle",))
        return self.graphs.run_idle(agree)

    def update_weights(self, source: Any) -> Any:
        """Copy new weights into this runner's model in place (``model.weight_update``)."""
        from replaylm.model.weight_update import update_weights

        return update_weights(self.model, source, self.full_cfg)

    def _run_with_prompt_rows(self, host: HostBatch, plan: PromptLogprobPlan, pad_to: int = 0):
        """An eager step that also returns logits of prompt-logprob rows (after the sampled
        rows): graphs size their logits rows for sampling only, so such steps skip them.
        ``pad_to``: the token count the data-parallel-attention ranks agreed on."""
        reason = "prompt_logprobs"
        self.graphs.stats.fallback(reason)
        if pad_to:
            host = host.padded(pad_to, self.buffers.scratch_slot)
        batch = to_device(host, self.last_token, self.buffers.slot_tables, self.device,
                          not self.attn.graph_safe)
        rows = torch.cat([batch.logits_indices, plan.rows])
        hidden = self.model(batch.input_ids, batch.positions, batch.meta, rows=rows)
        logits = self.model.compute_logits(hidden)
        return logits, batch, Dispatch("eager", reason=reason, pad_to=pad_to), host.num_tokens
