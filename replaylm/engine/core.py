"""The engine core: requests in, per-step deltas out. ``LLM`` and the server both drive it."""

from __future__ import annotations

import gc
import itertools
import logging
import time
from typing import Any

from replaylm.config import EngineArgs
from replaylm.engine.adapters import AdapterRequests
from replaylm.engine.block_manager import BlockManager
from replaylm.engine.draft_runner import load_draft_runner
from replaylm.engine.launched import Booked, Launched
from replaylm.engine.loading import load_model_config, load_tokenizer, resolve_weights_dir
from replaylm.engine.model_runner import ModelRunner
from replaylm.engine.observer import NO_OBSERVER, StepObserver
from replaylm.engine.output_processor import OutputState, attach_logprobs, make_delta
from replaylm.engine.outputs import RequestDelta
from replaylm.engine.request import Request, RequestStatus
from replaylm.engine.scheduler import Scheduler, SchedulerOutput
from replaylm.engine.speculation import Speculation, SpeculationAccess
from replaylm.engine.stats import EngineStats, StepRecord
from replaylm.engine.validation import RequestChecks, resolve_max_model_len
from replaylm.engine.weights_and_sleep import WeightsAndSleep
from replaylm.graphs.runtime import Agree
from replaylm.lora.manager import LoRAManager
from replaylm.lora.request import LoRARequest
from replaylm.model.parallel import DataParallelAttention, TensorParallel
from replaylm.sampling_params import SamplingParams, sibling_seed
from replaylm.structured.masks import StructuredOutputs

log = logging.getLogger(__name__)


class EngineCore(RequestChecks, AdapterRequests, WeightsAndSleep, SpeculationAccess):
    """Owns the scheduler, block manager and model runner; ``step()`` advances every request."""

    def __init__(self, args: EngineArgs, tp: TensorParallel | None = None,
                 dp: DataParallelAttention | None = None) -> None:
        """``tp``: this engine is the leader of a tensor-parallel group; ``dp``: its model's
        MLP is split across the data-parallel ranks (``distributed``)."""
        self.args = args
        self.model_config, model_dir = load_model_config(args.model)
        cfg = self.model_config
        weights_dir = resolve_weights_dir(model_dir, cfg, args.load_format)
        self.max_model_len = resolve_max_model_len(args, cfg)
        self.tokenizer = load_tokenizer(args, model_dir)
        # A draft model (``engine.draft_model``) loads first: the target's KV sizing reserves
        # its memory and pairs a draft block with each target block.
        spec = args.spec
        draft_runner = None
        if spec is not None and spec.method == "draft_model":
            draft_runner = load_draft_runner(args, spec, cfg, self.tokenizer, self.max_model_len)
        self.runner = ModelRunner(args, cfg, weights_dir, self.max_model_len, tp,
                                  kv_partner=draft_runner, dp=dp)
        self.graph_mode = self.runner.graph_mode
        self.block_manager = BlockManager(self.runner.num_blocks,
                                          enable_prefix_caching=args.enable_prefix_caching)
        kv_tokens = (self.runner.num_blocks - 1) * self.block_manager.block_size
        if kv_tokens < self.max_model_len:
            raise ValueError(f"the KV cache holds {kv_tokens} tokens, fewer than max_model_len="
                             f"{self.max_model_len}: raise the KV cache size or lower "
                             "max_model_len")
        self.scheduler = Scheduler(
            self.block_manager, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=self.max_model_len,
            enable_chunked_prefill=args.enable_chunked_prefill,
            max_mixed_prefill_tokens=args.max_mixed_prefill_tokens)
        # LoRA (``enable_lora``): adapters on the host and in the runner's device slots.
        self.lora: LoRAManager | None = None
        if self.runner.lora_slots is not None:
            self.lora = LoRAManager(cfg, self.runner.lora_slots,
                                    args.max_cpu_loras or args.max_loras, tp)
            self.lora.mirror = self._mirror_lora
            self.scheduler.adapters = self.lora
        self.stats = EngineStats(kv_blocks_total=self.runner.num_blocks - 1,
                                 graph_mode=self.graph_mode, graphs=self.runner.graphs.stats)
        # Caller's request id -> its requests (one, or the n siblings of n > 1).
        self.requests: dict[str, list[Request]] = {}
        self.outputs: dict[Request, OutputState] = {}
        self._arrivals = itertools.count()
        # Speculative decoding (``speculative_config``): drafts, verify steps, the budget.
        self.speculation = (Speculation(self, spec, draft_runner) if spec is not None
                            else None)
        self.stats.spec = self.spec_stats
        # Overlap scheduling: the CPU schedules and launches step N+1 while the GPU runs
        # step N. A request's step with drafts resolves before its next is built (the next
        # input is the last token its verify emitted), so with speculation overlap runs plain
        # steps, or pipelines two cohorts of requests (``Speculation.overlaps``).
        self.overlap = args.overlap_scheduling and (
            self.speculation is None or self.speculation.overlaps)
        self.inflight: Launched | None = None  # launched, not yet resolved (overlap)
        # Scheduled and booked as launched while a constrained step's masks filled; the next
        # step launches it (``launch``).
        self.booked: Booked | None = None
        # Structured outputs (``replaylm.structured``): grammar matchers, per-slot masks. A
        # step that samples a constrained request fills its masks while its forward runs.
        self.structured = StructuredOutputs(self.runner.buffers, cfg.vocab_size)
        self.step_observer: StepObserver = NO_OBSERVER
        # Data parallel: the ranks' tier agreement, called every step (``replaylm.distributed``).
        self.agree: Agree | None = None
        self.runner.prepare_sleep()  # every graph (the draft model's too) is captured by now
        if draft_runner is not None:
            draft_runner.prepare_sleep()
        if args.gc_gen0_threshold:  # for the process, once start-up's objects are made
            gc.set_threshold(args.gc_gen0_threshold, *gc.get_threshold()[1:])
        log.info("engine ready: %s on %s (%s), %d KV blocks, graph mode %s",
                 cfg.name, self.runner.device, self.runner.dtype, self.runner.num_blocks,
                 self.graph_mode)

    # Requests ------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> Request:
        """Queue a request; ``lora_request``: the LoRA adapter it runs with (None: the base
        model), read and checked now if the engine has not seen it."""
        params = params or SamplingParams()
        self._awake("add_request")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        try:
            ids = self.tokenize(prompt)
            self.validate(ids, params)
            self.add_lora(lora_request)
            grammar = self.compile_structured(params)
        except ValueError:
            self.stats.requests_rejected += 1
            raise
        arrival = next(self._arrivals)
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        seed = params.seed if params.seed is not None else (self.args.seed * 1_000_003 + arrival)
        internal = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        taken = [i for i in internal if i in self.scheduler.unfinished_ids]
        if taken:
            self.stats.requests_rejected += 1
            raise ValueError(f"request_id {taken[0]!r} is already in use")
        group = []
        for i, rid in enumerate(internal):
            req = Request(
                rid, ids, params, arrival=arrival, seed=sibling_seed(seed, i),
                eos_token_ids=self.model_config.eos_token_ids, max_tokens=max_tokens,
                prompt=prompt if isinstance(prompt, str) else None,
                parent_id=request_id, index=i,
            )
            req.leader = group[0] if group else None
            req.lora_int_id = lora_request.lora_int_id if lora_request is not None else 0
            if grammar is not None:  # each sibling walks the grammar on its own
                self.structured.add(req, self._matcher(grammar))
            group.append(req)
            self.outputs[req] = OutputState(req, self.tokenizer)
            self.scheduler.add(req)
        self.requests[request_id] = group
        self.stats.requests_added += 1
        self.stats.prompt_tokens += len(ids)
        return group[0]

    @staticmethod
    def _matcher(grammar: Any) -> Any:
        import xgrammar

        return xgrammar.GrammarMatcher(grammar)

    def abort(self, request_id: str) -> bool:
        """Stop a request (every sibling) now and free its blocks; False if unknown or done."""
        group = self.requests.get(request_id)
        if group is None:
            return False
        aborted = [self.scheduler.abort(r.request_id) for r in group]
        for r in group:
            self.structured.release(r)
        self._forget(request_id)
        if not any(aborted):
            return False
        self.stats.requests_aborted += 1
        return True

    def _forget(self, request_id: str) -> None:
        for req in self.requests.pop(request_id, []):
            self.outputs.pop(req, None)

    @property
    def device(self):
        return self.runner.device

    @property
    def dtype(self):
        return self.runner.dtype

    def graph_stats(self) -> dict:
        """The graph runtime's statistics; under tensor parallel also ``all_reduce``, how the
        group sums (``model.allreduce``: the setting, the plan, the measured latencies)."""
        stats = self.runner.graphs.stats.as_dict()
        if self.runner.all_reduce_report is not None:
            stats["all_reduce"] = self.runner.all_reduce_report
        return stats

    @property
    def live_stats(self) -> EngineStats:
        """The counters as another thread may read them (the same object as ``stats``)."""
        return self.stats

    def shutdown(self) -> None:
        """Nothing to end: this engine holds no process (``Engine`` protocol)."""

    def has_unfinished(self) -> bool:
        return (self.scheduler.has_unfinished or self.inflight is not None
                or self.booked is not None)

    # The step --------------------------------------------------------------------------------

    def step(self) -> list[RequestDelta]:
        """Schedule and launch one step, then resolve the previous one and report what changed.

        With overlap scheduling the step launched here is resolved by the next call: the CPU
        schedules and builds step N+1 while the GPU runs step N, and samples reach the host one
        step late. Without it, each step is resolved before returning. With speculative
        decoding the step is ``Speculation.step``.

        A failure that belongs to one request (writing its sampling settings into its slot,
        detokenizing its text, matching its stop strings) finishes that request with
        ``finish_reason="error"`` and the step goes on for the others. Anything else raised
        here is an engine fault: the caller must treat every request as failed.
        """
        self.step_observer.begin()
        if self.speculation is None:
            booked, self.booked = self.booked, None
            out = booked.out if booked is not None else self.scheduler.schedule()
            launched, deltas = self.launch(out, apply_inflight=True, booked=booked)
            for due in self.due(launched, keep_in_flight=self.overlap):
                deltas += self.resolve(due)
        else:
            launched, deltas = self.speculation.step()
        self._refresh_gauges()
        self.step_observer.end(launched is not None)
        return deltas

    def launch(self, out: SchedulerOutput, apply_inflight: bool = False,
               booked: Booked | None = None) -> tuple[Launched | None, list[RequestDelta]]:
        """Launch ``out``; the launched step, and the deltas of requests that failed on the way
        in. Nothing waits for the device but a step that samples a constrained request: once
        its forward is launched, it waits for the step in flight, whose tokens its grammars
        take before its masks are filled (``structured.masks``); with ``apply_inflight`` that
        step is then applied while the masks fill, its deltas come first, and the next step is
        scheduled, built and booked as launched right after it (``Booked``: the next ``step``
        launches it), so the host's scheduling overlaps the fill rather than following it. A
        data-parallel rank with nothing scheduled runs its part of the ranks' step idle."""
        self.stats.preemptions += len(out.preempted)
        if out.is_empty:
            if self.agree is not None:
                self.runner.idle(self.agree)
            return None, []
        obs, structured = self.step_observer, self.structured
        split = structured.in_step(out)  # its masks are filled while its forward runs
        inflight = self.inflight
        applied: list[RequestDelta] | None = None

        def before_launch() -> None:  # the host batch is built; nothing is on the device yet
            if structured.busy:
                structured.begin(out)  # slot flags
            obs.launching()

        def apply() -> None:  # the step in flight, after this one (launched) in the books
            nonlocal applied
            if booked is None:
                self.scheduler.launched(out)
            applied = self.resolve(inflight)
            self._book_next()

        def between() -> None:  # the forward is on the device, the tail (masks) is not
            if inflight is not None:
                self.advance_grammars(inflight)  # the masks continue its tokens
            structured.prepare(out, apply if apply_inflight and inflight is not None else None)

        pending, dispatch, padded = self.runner.execute(
            out, on_launch=before_launch, agree=self.agree, on_forward=between if split else None,
            host=booked.host if booked is not None else None)
        obs.launched(dispatch.mode, dispatch.tier, out.num_batched_tokens)
        if applied is not None:
            self.inflight = None  # applied while the masks filled
        elif booked is None:
            self.scheduler.launched(out)
        errors = (applied or []) + [self._fail(req, e)
                                    for req, e in self.runner.sampler.take_failed()]
        self.stats.record_step(StepRecord(
            mode=dispatch.mode, tier=dispatch.tier, real_tokens=out.num_batched_tokens,
            padded_tokens=padded, num_reqs=len(out.scheduled),
            fallback_reason=dispatch.reason, prefill_tokens=out.num_prefill_tokens,
        ))
        return Launched(out, pending, dispatch, padded), errors

    def _book_next(self) -> None:
        """Schedule what the next ``step`` would, build its host batch and book it as launched
        (its requests then count as in flight: an abort parks them); ``step`` launches it."""
        upcoming = self.scheduler.schedule()
        if upcoming.is_empty:
            self.stats.preemptions += len(upcoming.preempted)
            return
        self.booked = Booked(upcoming, self.runner.build(upcoming))  # before it is booked
        self.scheduler.launched(upcoming)

    def due(self, launched: Launched | None, keep_in_flight: bool) -> list[Launched]:
        """The steps to resolve now, in launch order: the one in flight, and ``launched``
        unless it stays in flight until the next step (``keep_in_flight``)."""
        due = [self.inflight] if self.inflight is not None else []
        self.inflight = launched if keep_in_flight else None
        if launched is not None and not keep_in_flight:
            due.append(launched)
        return due

    def resolve(self, step: Launched) -> list[RequestDelta]:
        """Wait for a launched step's samples and apply them (stop checks, deltas)."""
        return self.apply(step, self.wait(step))

    def wait(self, step: Launched) -> list[int]:
        """A launched step's sampled tokens, on the host (waited for once)."""
        if step.sampled is None:
            t0 = time.perf_counter()
            step.sampled = step.pending.tokens() if step.pending is not None else []
            self.step_observer.waited(time.perf_counter() - t0)
        return step.sampled

    def advance_grammars(self, step: Launched) -> None:
        """Let the grammars of ``step``'s constrained requests take its tokens now, ahead of
        the rest of ``apply`` (``structured.masks``: the overlap rule)."""
        if step.refused is None:
            step.refused = self.structured.advance(step.out, self.wait(step))

    def apply(self, step: Launched, sampled: list[int]) -> list[RequestDelta]:
        """Apply a step's samples to its requests: outputs, stop checks, deltas."""
        attach_logprobs(step.out, step.pending, sampled)
        if step.refused is None and self.structured.requests:
            self.advance_grammars(step)
        refused = step.refused or []
        changed = self.scheduler.update(step.out, sampled)
        deltas = [self._fail(req, e) for req, e in refused]
        for req in changed:
            if req.is_finished and req.status is RequestStatus.FINISHED_ERROR:
                continue  # refused by its grammar above
            if self.structured.finished_by_grammar(req):
                self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
            try:
                delta = make_delta(req, self.outputs[req], self.scheduler)
            except Exception as e:  # detokenizing or stop matching: this request's failure
                deltas.append(self._fail(req, e))
                continue
            self.stats.generated_tokens += len(delta.new_token_ids)
            deltas.append(self._delta(req, delta))
        return deltas

    # Bookkeeping -------------------------------------------------------------------------------

    def _delta(self, req: Request, delta: RequestDelta) -> RequestDelta:
        if delta.finished:
            self.structured.release(req)
            self.outputs.pop(req, None)
            group = self.requests.get(req.parent_id)
            if group is not None and all(r.is_finished for r in group):
                self.stats.requests_finished += 1
                self.requests.pop(req.parent_id, None)
        return delta

    def _fail(self, req: Request, err: Exception) -> RequestDelta:
        """Finish ``req`` alone with ``finish_reason="error"``; its blocks and slot are freed
        (or parked until a step in flight that uses them resolves) like any finish."""
        message = f"{type(err).__name__}: {err}"
        log.warning("request %s failed (the others go on): %s", req.request_id, message,
                    exc_info=err)
        if not req.is_finished:
            self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
        req.status = RequestStatus.FINISHED_ERROR
        req.error = message
        self.stats.requests_failed += 1
        return self._delta(req, RequestDelta(
            req.parent_id, [], "", True, req.status.finish_reason,
            num_prompt_tokens=req.num_prompt_tokens, index=req.index, error=message))

    def _refresh_gauges(self) -> None:
        self.stats.running = self.scheduler.num_running
        self.stats.waiting = self.scheduler.num_waiting
        self.stats.kv_blocks_used = self.block_manager.num_used_blocks
        cache = self.block_manager.cache
        if cache is not None:
            self.stats.prefix_cache_queried_tokens = cache.queried_tokens
            self.stats.prefix_cache_hit_tokens = cache.hit_tokens
            self.stats.kv_blocks_cached = len(cache.entries)
            self.stats.prefix_cache_evictions = cache.evictions


__all__ = ["EngineCore", "RequestStatus"]
