"""The model runner: owns the model, the KV pool and the per-slot device state; runs steps."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from replaylm.batch import BLOCK_SIZE, HostBatch, to_device
from replaylm.config import EngineArgs
from replaylm.engine.kv_sizing import KVSizing
from replaylm.engine.packing import build_host_batch
from replaylm.engine.request import Request
from replaylm.engine.runner_memory import RunnerMemory
from replaylm.engine.runner_setup import (
    RunnerStartup,
    make_attention_backend,
    resolve_device,
    resolve_dtype,
)
from replaylm.engine.scheduler import SchedulerOutput
from replaylm.engine.step_input import (
    StepInput,
    from_leader,
    prompt_plan,
    sent_to_group,
)
from replaylm.graphs.buffers import StepUploads
from replaylm.graphs.policy import Dispatch, GraphPolicy, resolve_mode
from replaylm.graphs.runtime import Agree, GraphRuntime
from replaylm.kernels import compile_plan
from replaylm.lora.peft import load_adapter
from replaylm.lora.request import LoRARequest
from replaylm.lora.slots import LoRASlots
from replaylm.memory.arena import Arena, Region, adopt_parameters
from replaylm.memory.sleep import Sleeper
from replaylm.model.compressed_tensors import fp8_scheme
from replaylm.model.config import ModelConfig
from replaylm.model.llama import CausalLM
from replaylm.model.loader import load_model
from replaylm.model.parallel import (
    DataParallelAttention,
    TensorParallel,
    dp_attention_config,
    shard_config,
)
from replaylm.sampling.bitmask import apply_token_bitmask
from replaylm.sampling.step import (
    Accept,
    PendingStep,
    PromptLogprobPlan,
    SampleRows,
    StepSampler,
)
from replaylm.speculative.acceptance import emitted_rows
from replaylm.speculative.config import SpecConfig

log = logging.getLogger(__name__)

class ModelRunner(RunnerStartup, KVSizing, RunnerMemory):
    """Owns one model, its KV pool, its graphs and the per-slot sampling state; runs steps.

    ``kv_partner``: a second pool sized with this one (a draft model's,
    ``engine.draft_model``): its ``partner_block_bytes`` are added to each of this pool's
    blocks and its ``partner_fixed_bytes`` reserved, before the KV pool is sized.
    ``verify_accept``: set by the engine when a drafter's proposals carry a distribution;
    it turns a verify step into that drafter's acceptance rule (``StepSampler.run``). Under
    tensor parallel the drafter lives on the leader alone: the leader applies the rule and
    broadcasts the kept tokens to the group, so every rank's ``last_token`` and penalty
    counts stay the same. Structured outputs work the same way: the leader alone holds the
    grammars and applies their masks, and broadcasts the tokens of every step while a mask
    is on (``StepInput.tokens_from_leader``); a follower's mask flags stay off.

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
        self.spec: SpecConfig | None = args.spec
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
        self.arena, weights = self._adopt_weights()
        self.lora_slots = self._start_lora()  # before the KV sizing, which counts them
        self.compile_plan = self._compile_ahead()
        self.all_reduce_report = self._configure_all_reduce()
        self.sampler = StepSampler(args.max_num_seqs, self.cfg.vocab_size, self.device,
                                   max_rows=args.max_num_seqs * self.rows_per_req)
        t0 = time.perf_counter()
        if args.max_num_kv_blocks is not None and self.arena is None:
            self.arena = Arena(self.device)  # a resizable pool: its addresses reserved
        self.num_blocks = self._aligned_blocks(self._decide_num_blocks(), self.arena)
        if args.max_num_kv_blocks is not None:
            self.num_blocks = min(self.num_blocks, args.max_num_kv_blocks)
        if tp is not None:  # the leader's block ids index every rank's pool
            self.num_blocks = tp.min_int(self.num_blocks)
        self.kv_caches = self._allocate_kv(self.num_blocks, self.arena,
                                           args.max_num_kv_blocks or self.num_blocks)
        self.sleeper = (Sleeper(self.arena, [weights], [self.arena.regions["kv"]])
                        if weights is not None else None)
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
        fp8 = fp8_scheme(self.full_cfg, model_dir, args.quantization, args.quantize_lm_head)
        self.model: CausalLM = load_model(
            cfg, model_dir, args.load_format, self.dtype, self.device, args.seed, self.tp,
            self.full_cfg, self.dp, fp8)
        self.load_seconds = time.perf_counter() - t0
        self.model.poison_padding = args.poison_padding
        self.model.use_side_stream(args.moe_side_stream_max_tokens)
        # Fused Triton kernels for the dense links go with the Triton attention backend.
        self.model.use_fused_kernels(args.fused_kernels and self.attn.name == "triton")
        self.model.rope_in_attention_max_reqs = (
            self.policy.rope_in_attention_max_reqs(args.rope_in_attention_max_reqs)
            if self.model.kernels is not None else 0)

    def _start_lora(self) -> LoRASlots | None:
        """With ``enable_lora``: the adapter slots (static buffers, ``lora.slots``) and each
        decoder layer's hook into them; None otherwise."""
        args = self.args
        if not args.enable_lora:
            return None
        # Every token a step may pack: the budget, a graph tier, a verify's padding rows.
        max_tokens = (max(args.max_num_batched_tokens, self.policy.top_tier)
                      + args.max_num_seqs * self.rows_per_req)
        slots = LoRASlots(self.cfg, args.max_loras, args.max_lora_rank, max_tokens, self.dtype,
                          self.device)
        for layer, hook in zip(self.model.layers, slots.hooks()):
            layer.lora = hook
        log.info("LoRA: %d adapter slots of rank %d, %.1f MiB", args.max_loras,
                 args.max_lora_rank,
                 LoRASlots.nbytes(self.cfg, args.max_loras, args.max_lora_rank, self.dtype)
                 / 2**20)
        return slots

    def load_lora(self, slot: int, request: LoRARequest) -> None:
        """A tensor-parallel follower: load this rank's shard of ``request``'s adapter into
        ``slot``, as the leader's ``LoRAManager`` did (``("lora_load", ...)``)."""
        adapter = load_adapter(request, self.full_cfg, self.args.max_lora_rank, self.dtype,
                               tp=self.tp)
        self.lora_slots.load(slot, adapter)

    def _adopt_weights(self) -> tuple[Arena | None, Region | None]:
        """Sleep mode: move the weights into an arena region (before anything captures
        their addresses); the KV pool joins it when allocated."""
        if not self.args.enable_sleep_mode:
            return None, None
        arena = Arena(self.device)
        region = adopt_parameters(self.model, arena, "weights")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the weights' old blocks: the KV sizing reads free memory
        return arena, region

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
            pad_to_agreed=self.dp is not None, split_tails=self.split_tails,
        )
        self.buffers = self.graphs.buffers
        if self.samples_in_tail:
            self.buffers.sampling = self.sampler.state
            self.sampler.tail_draws = True
        self.last_token = self.buffers.last_token  # [S+1]: each slot's newest sample
        # A verify's rows (drafts, segment starts, penalty counts): room for a whole step's
        # tokens several times over (``StepUploads``).
        self.uploads = StepUploads(
            4 * args.max_num_batched_tokens if self.spec is not None else 0, self.device)
        self.layout_pad_tokens = 0  # padded verify layout: the latest step's padding rows
        self.tune_seconds = self._tune_kernels()
        jit_before = self._jit_snapshot()
        self.graphs.capture(self.arena)
        self.capture_jit = self._jit_snapshot().since(jit_before)

    # Steps ---------------------------------------------------------------------------------

    def admit(self, req: Request) -> None:
        """Write a newly slotted request's sampling settings into its slot."""
        self.sampler.admit(req)

    def build(self, out: SchedulerOutput) -> HostBatch:
        """Step ``out``'s host batch (``engine.packing``), from its requests' state before the
        step is booked as launched (``Scheduler.launched``)."""
        spec = self.spec
        pad_to = spec.num_speculative_tokens + 1 if spec and spec.verify == "padded" else 0
        return build_host_batch(out, self.max_blocks_per_req, pad_to, self.max_model_len)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, on_launch: Callable[[], None] | None = None,
                agree: Agree | None = None, on_forward: Callable[[], None] | None = None,
                host: HostBatch | None = None) -> tuple[PendingStep | None, Dispatch, int]:
        """Launch one step; returns the pending samples, the dispatch and the padded size.
        ``agree``: data-parallel tier agreement (``GraphRuntime.dispatch``); ``host``: its
        host batch, when built already (``build``).

        Nothing here waits for the device (``on_forward`` may): the samples are read later,
        from the ``PendingStep``. ``on_launch`` runs after the host-only work, right before
        the step's first device operation (the profiler's start event); ``on_forward`` once
        the step's forward is launched, before its tail (masks, the samples)
        is (``GraphRuntime.run``'s ``between``), so the host works while the forward runs.
        """
        if host is None:
            host = self.build(out)
        self.layout_pad_tokens = host.layout_pad_tokens  # the latest step's (spec stats)
        if on_launch is not None:
            on_launch()
        # A drafter's acceptance rule reads the schedule alone (a verifying request was
        # slotted in an earlier step), so it is known before the step goes out.
        accept = (self.verify_accept(out, self.sampler.state)
                  if host.draft_next is not None and self.verify_accept is not None else None)
        if self.broadcast is None:
            return self._launch(host, out.newly_slotted, prompt_plan(out, host, self.device),
                                agree, accept, on_forward)
        # Masks are the leader's alone: while a slot's flag is on, the group takes its tokens.
        step = StepInput.of(out, host, accept is not None or self.buffers.bitmask_any)
        self.broadcast(("step", step))
        plan = step.plan
        if plan is not None:  # the leader's plan keeps the requests (its output spans)
            plan = prompt_plan(out, host, self.device)
        if step.tokens_from_leader and self.tp is not None:
            accept = sent_to_group(accept, self.tp)
        return self._launch(host, out.newly_slotted, plan, agree, accept, on_forward)

    @torch.inference_mode()
    def run_step(self, step: StepInput, agree: Agree | None = None
                 ) -> tuple[PendingStep | None, Dispatch, int]:
        """A tensor-parallel rank's part of the step its leader launched (``execute``)."""
        plan = step.plan
        if plan is not None:
            plan = dataclasses.replace(plan, rows=plan.rows.to(self.device),
                                       targets=plan.targets.to(self.device))
        accept = None
        if step.tokens_from_leader and self.tp is not None:
            accept = from_leader(self.tp)
        return self._launch(step.host, step.admitted, plan, agree, accept)

    def _launch(self, host: HostBatch, admitted: list, plan: PromptLogprobPlan | None,
                agree: Agree | None, accept: Accept | None = None,
                on_forward: Callable[[], None] | None = None,
                ) -> tuple[PendingStep | None, Dispatch, int]:
        """The device part of a step (``accept``: a verify's acceptance rule beyond exact
        matching, ``StepSampler.run``; ``on_forward``: as ``execute``'s)."""
        for req in admitted:
            self.admit(req)
        self.sampler.flush()
        self.buffers.update_block_tables(host)
        if self.lora_slots is not None:
            self.lora_slots.set_step(host.lora_slots, host.cu_seqlens_q)
        spec = self.spec
        if plan is None:
            eager = (spec is not None and spec.verify == "eager" and host.draft_next is not None
                     and self.policy.mode != "eager")
            res = self.graphs.run(host, agree, "speculative_config verify=eager" if eager else None,
                                  on_forward)
            logits, samples, batch = res.logits, res.samples, res.batch
            dispatch, padded = res.dispatch, res.padded_tokens
        else:
            pad_to = 0
            if agree is not None:  # the other ranks run this step eagerly too
                pad_to = self.graphs.dispatch(host.num_tokens, host.num_reqs,
                                              host.is_uniform_decode, False, agree).pad_to
            logits, batch, dispatch, padded = self._run_with_prompt_rows(host, plan, pad_to,
                                                                         on_forward)
            samples = None
        n = host.num_sampled
        if n == 0 and plan is None:
            return None, dispatch, padded
        slots = batch.sample_slots[:n]
        # Penalties, logit_bias, min_p, min_tokens and logprobs (when asked) then sampling.
        host_view = None
        draft_counts = None
        if host.draft_next is not None:  # a verify: rows past a rejected draft read -1
            draft_next, seg_start, count_rows, count_tokens = self.uploads.upload(
                host.draft_next, host.seg_start, host.draft_count_rows, host.draft_count_tokens)

            def host_view(tokens: torch.Tensor) -> torch.Tensor:
                return torch.where(emitted_rows(tokens, draft_next, seg_start), tokens, -1)
            if count_rows is not None:  # penalties see the drafts before each row
                draft_counts = (count_rows, count_tokens)
        pending = self.sampler.run(SampleRows(
            logits, slots, batch.sample_out_pos[:n], host.sample_slots.tolist(), plan, samples,
            host_view, draft_counts, accept))
        if pending.device_tokens is not samples:
            self.last_token.index_copy_(0, slots, pending.device_tokens)
        return pending, dispatch, padded

    @torch.inference_mode()
    def idle(self, agree: Agree) -> Dispatch:
        """A data-parallel step with no work on this rank (``GraphRuntime.run_idle``)."""
        if self.broadcast is not None:
            self.broadcast(("idle",))
        return self.graphs.run_idle(agree)

    def _run_with_prompt_rows(self, host: HostBatch, plan: PromptLogprobPlan, pad_to: int = 0,
                              on_forward: Callable[[], None] | None = None):
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
        if on_forward is not None:
            on_forward()
        n = host.num_sampled  # structured outputs' masks, on the sampled rows only
        if self.buffers.bitmask_any:
            apply_token_bitmask(logits[:n], self.buffers.token_bitmask,
                                self.buffers.bitmask_on, batch.sample_slots[:n])
        return logits, batch, Dispatch("eager", reason=reason, pad_to=pad_to), host.num_tokens
