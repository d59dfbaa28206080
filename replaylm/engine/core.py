"""The engine core: requests in, per-step deltas out. ``LLM`` and the server both drive it."""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any

from replaylm.config import EngineArgs
from replaylm.engine.block_manager import BlockManager
from replaylm.engine.loading import (
    load_model_config,
    load_tokenizer,
    resolve_weights_dir,
    tokenize_text,
    too_long_message,
)
from replaylm.engine.model_runner import ModelRunner
from replaylm.engine.output_processor import OutputState, attach_logprobs, make_delta
from replaylm.engine.outputs import RequestDelta
from replaylm.engine.request import Request, RequestStatus
from replaylm.engine.scheduler import Scheduler, SchedulerOutput
from replaylm.engine.stats import EngineStats, StepRecord
from replaylm.model.config import ModelConfig
from replaylm.model.parallel import DataParallelAttention, TensorParallel
from replaylm.sampling.step import PendingStep
from replaylm.sampling_params import SamplingParams
from replaylm.speculative.adaptive import AdaptiveBudget, eager_tiers
from replaylm.speculative.config import SpecConfig
from replaylm.speculative.drafter import make_drafter
from replaylm.speculative.stats import SpecStats

log = logging.getLogger(__name__)

MAX_DEFAULT_MODEL_LEN = 8192


class EngineCore:
    """Owns the scheduler, block manager and model runner; ``step()`` advances every request."""

    def __init__(self, args: EngineArgs, tp: TensorParallel | None = None,
                 dp: DataParallelAttention | None = None) -> None:
        """``tp``: this engine is the leader of a tensor-parallel group; ``dp``: its model's
        MLP is split across the data-parallel ranks (``distributed``)."""
        self.args = args
        self.model_config, model_dir = load_model_config(args.model)
        cfg = self.model_config
        weights_dir = resolve_weights_dir(model_dir, cfg, args.load_format)
        self.max_model_len = self._resolve_max_model_len(args, cfg)
        self.tokenizer = load_tokenizer(args, model_dir)
        # A draft model (``engine.draft_model``) loads first: the target's KV sizing reserves
        # its memory and pairs a draft block with each target block.
        spec = SpecConfig.from_dict(args.speculative_config) \
            if args.speculative_config is not None else None
        draft_runner = None
        if spec is not None and spec.method == "draft_model":
            from replaylm.engine.draft_model import load_draft_runner

            draft_runner = load_draft_runner(args, spec, cfg, self.tokenizer, self.max_model_len)
        self.runner = ModelRunner(args, cfg, weights_dir, self.max_model_len, tp,
                                  kv_partner=draft_runner, dp=dp)
        self.graph_mode = self.runner.graph_mode
        self.block_manager = BlockManager(self.runner.num_blocks,
                                          enable_prefix_caching=args.enable_prefix_caching)
        if (self.runner.num_blocks - 1) * self.block_manager.block_size < self.max_model_len:
            raise ValueError(
                f"the KV cache holds {(self.runner.num_blocks - 1) * 16} tokens, fewer than "
                f"max_model_len={self.max_model_len}: raise the KV cache size or lower max_model_len"
            )
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_chunked_prefill=args.enable_chunked_prefill,
        )
        self.stats = EngineStats(kv_blocks_total=self.runner.num_blocks - 1,
                                 graph_mode=self.graph_mode, graphs=self.runner.graphs.stats)
        # Caller's request id -> its requests (one, or the n siblings of n > 1).
        self.requests: dict[str, list[Request]] = {}
        self.outputs: dict[Request, OutputState] = {}
        self._arrivals = itertools.count()
        # Speculative decoding (``speculative_config``): the drafter and its counters. Steps
        # then resolve before the next is built (no overlap): the next step's input is the
        # last token each verify emitted, known on the host only after acceptance.
        self.spec_stats = (SpecStats(spec.num_speculative_tokens, spec.budget, spec.verify)
                           if spec else None)
        self.drafter: Any = make_drafter(spec) if spec and draft_runner is None else None
        if draft_runner is not None:
            from replaylm.engine.draft_model import DraftModelDrafter

            self.drafter = DraftModelDrafter(draft_runner, spec, self.runner.num_blocks,
                                             self.max_model_len, self.runner.sampler.state,
                                             self.spec_stats)
            self.scheduler.on_release = self.drafter.release
            self.runner.verify_accept = self.drafter.acceptance
        self.stats.spec = self.spec_stats
        self.budget = None
        if spec is not None and spec.budget == "adaptive":
            top = self.runner.policy.top_tier
            tiers = self.runner.policy.token_tiers + [
                t for t in eager_tiers(args.max_num_batched_tokens) if t > top]
            self.budget = AdaptiveBudget(tiers, spec.num_speculative_tokens)
        # Overlap scheduling runs plain steps; a step with drafts resolves before the next
        # is built (the next input is the last token its verify emitted). So with
        # speculation it pays only where plain steps run: the adaptive budget's coasting,
        # for drafters without device state.
        self._overlap = args.overlap_scheduling and (
            spec is None or (self.budget is not None and draft_runner is None))
        self._last_end: float | None = None  # end of the previous step that launched work
        # Overlap scheduling: the launched step not yet resolved (its output and samples).
        self._inflight: tuple[SchedulerOutput, PendingStep | None] | None = None
        # Per-step hooks (``replaylm.bench.profile.StepProfiler``): begin, launching,
        # launched, waited, end.
        self.step_observer: Any = None
        # Data parallel: the ranks' tier agreement, called every step (``replaylm.distributed``).
        self.agree: Any = None
        log.info("engine ready: %s on %s (%s), %d KV blocks, graph mode %s",
                 cfg.name, self.runner.device, self.runner.dtype, self.runner.num_blocks,
                 self.graph_mode)

    @staticmethod
    def _resolve_max_model_len(args: EngineArgs, cfg: ModelConfig) -> int:
        limit = cfg.max_position_embeddings
        if args.max_model_len is None:
            return min(limit, MAX_DEFAULT_MODEL_LEN)
        if args.max_model_len > limit:
            raise ValueError(
                f"EngineArgs.max_model_len={args.max_model_len} exceeds the model's "
                f"max_position_embeddings={limit}"
            )
        return args.max_model_len

    # Requests ------------------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int], add_special_tokens: bool = True,
                 tokenizer: Any = None) -> list[int]:
        """Token ids of ``prompt`` (ids pass through). Reads nothing the engine changes, so
        it may run on any thread; ``tokenizer`` (default: the engine's) lets a thread use
        its own copy."""
        if isinstance(prompt, str):
            tok = tokenizer if tokenizer is not None else self.tokenizer
            if tok is None:
                raise ValueError(
                    "this engine has no tokenizer (skip_tokenizer_init, or a named shape): "
                    "pass prompts as lists of token ids"
                )
            return tokenize_text(tok, prompt, self.max_model_len, add_special_tokens)
        return list(prompt)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ``ValueError`` for a request the engine cannot run; changes nothing.

        The length is checked before any per-token work, so an oversized prompt costs O(1).
        """
        if not prompt_ids:
            raise ValueError("prompt is empty: a request needs at least one prompt token")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(too_long_message(len(prompt_ids), self.max_model_len))
        bad = [t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise ValueError(
                f"prompt token id {bad[0]!r} is outside the vocabulary [0, {self.model_config.vocab_size})"
            )
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, not {type(params).__name__}")
        validate_features(params, self.args, self.model_config.vocab_size,
                          has_tokenizer=self.tokenizer is not None)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
    ) -> Request:
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        try:
            ids = self.tokenize(prompt)
            self.validate(ids, params)
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
            group.append(req)
            self.outputs[req] = OutputState(req, self.tokenizer)
            self.scheduler.add(req)
        self.requests[request_id] = group
        self.stats.requests_added += 1
        self.stats.prompt_tokens += len(ids)
        return group[0]

    def abort(self, request_id: str) -> bool:
        """Stop a request (every sibling) now and free its blocks; False if unknown or done."""
        group = self.requests.get(request_id)
        if group is None:
            return False
        aborted = [self.scheduler.abort(r.request_id) for r in group]
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
        return self.scheduler.has_unfinished or self._inflight is not None

    # The step --------------------------------------------------------------------------------

    def step(self) -> list[RequestDelta]:
        """Schedule and launch one step, then resolve the previous one and report what changed.

        With overlap scheduling the step launched here is resolved by the next call: the CPU
        schedules and builds step N+1 while the GPU runs step N, and samples reach the host one
        step late. Without it, each step is resolved before returning.

        A failure that belongs to one request (writing its sampling settings into its slot,
        detokenizing its text, matching its stop strings) finishes that request with
        ``finish_reason="error"`` and the step goes on for the others. Anything else raised
        here is an engine fault: the caller must treat every request as failed.
        """
        obs = self.step_observer
        if obs is not None:
            obs.begin()
        early: list[RequestDelta] = []
        budget = self.budget
        coasting = budget is not None and budget.coasting and self._overlap
        if self.drafter is not None and not coasting:
            if self._inflight is not None:  # drafts continue every request's latest token
                early = self._resolve(*self._inflight)
                self._inflight = None
                self._last_end = None  # this step's time includes the previous one's wait
            self._propose_drafts()
        elif coasting:
            self._shadow_round()
        out = self.scheduler.schedule()
        self.stats.preemptions += len(out.preempted)
        launched = None
        errors: list[RequestDelta] = []
        if not out.is_empty:
            pending, dispatch, padded = self.runner.execute(
                out, on_launch=obs.launching if obs is not None else None, agree=self.agree)
            if obs is not None:
                obs.launched(dispatch.mode, dispatch.tier, out.num_batched_tokens)
            self.scheduler.launched(out)
            errors = [self._fail(req, e) for req, e in self.runner.sampler.take_failed()]
            self.stats.record_step(StepRecord(
                mode=dispatch.mode, tier=dispatch.tier, real_tokens=out.num_batched_tokens,
                padded_tokens=padded, num_reqs=len(out.scheduled),
                fallback_reason=dispatch.reason,
            ))
            if self.spec_stats is not None:
                self.spec_stats.record_launch(out.scheduled, out.num_batched_tokens, padded,
                                              self.runner.layout_pad_tokens)
            launched = (out, pending)
        elif self.agree is not None:
            self.runner.idle(self.agree)
        verified = (launched is not None and self.drafter is not None
                    and any(s.drafts for s in out.scheduled))
        if self._overlap and not verified:
            resolve = [self._inflight] if self._inflight is not None else []
            self._inflight = launched
        else:  # in launch order
            resolve = [x for x in (self._inflight, launched) if x is not None]
            self._inflight = None
        deltas = early + errors
        for step in resolve:
            deltas += self._resolve(*step)
        if budget is not None:
            # The step's cost: end of the previous step to the end of this one, counted
            # where it includes a wait for the GPU (plain with overlap: the previous step's;
            # otherwise its own, after a step that left nothing in flight).
            now = time.perf_counter()
            steady = resolve and (verified or not self._overlap or resolve[0] is not launched)
            if launched is not None and self._last_end is not None and steady:
                budget.observe_step(dispatch.tier if dispatch.graphed
                                    else budget.tier_of(out.num_batched_tokens),
                                    now - self._last_end, verified)
            self._last_end = now if launched is not None else None
            if budget.coasting and budget.shadow:
                budget.shadow_check(getattr(self.drafter, "shadow_accepted", None),
                                    self._generating, self._base_tokens)
        self._refresh_gauges()
        if obs is not None:
            obs.end(launched is not None)
        return deltas

    def _resolve(self, out: SchedulerOutput, pending: PendingStep | None) -> list[RequestDelta]:
        """Wait for a launched step's samples and apply them (stop checks, deltas)."""
        obs = self.step_observer
        t0 = time.perf_counter() if obs is not None else 0.0
        sampled = pending.tokens() if pending is not None else []
        if obs is not None:
            obs.waited(time.perf_counter() - t0)
        if self.spec_stats is not None:
            for req, k, accepted in self.spec_stats.record_resolve(out.scheduled, sampled):
                if self.budget is not None:
                    self.budget.observe_verify(req, k, accepted)
        attach_logprobs(out, pending, sampled)
        changed = self.scheduler.update(out, sampled)
        deltas = []
        for req in changed:
            try:
                delta = make_delta(req, self.outputs[req], self.scheduler)
            except Exception as e:  # detokenizing or stop matching: this request's failure
                deltas.append(self._fail(req, e))
                continue
            self.stats.generated_tokens += len(delta.new_token_ids)
            deltas.append(self._delta(req, delta))
        return deltas

    def use_drafter(self, drafter: Any) -> None:
        """Propose drafts with ``drafter`` (``speculative.drafter.Drafter``) from the next step on,
        in place of the one ``speculative_config`` named; the rest of the configuration
        (``num_speculative_tokens``, budget, verify layout) stays. A drafter with an
        ``acceptance`` method decides its verify rows' tokens with it
        (``ModelRunner.verify_accept``). Benchmarks use it for drafters with a known
        acceptance rate (``replaylm.bench.spec``)."""
        if self.drafter is None:
            raise ValueError("use_drafter needs speculative decoding on "
                             "(EngineArgs.speculative_config)")
        self.drafter = drafter
        self.runner.verify_accept = getattr(drafter, "acceptance", None)

    def _decoding(self) -> list[Request]:
        """Running requests whose next step decodes one token (the ones that may draft)."""
        return [r for r in self.scheduler.running
                if r.num_tokens - r.num_computed_tokens == 1 and r.num_output_tokens]

    def _draft_room(self, reqs: list[Request]) -> list[int]:
        k = self.runner.spec.num_speculative_tokens  # type: ignore[union-attr]
        return [min(k, r.max_tokens - r.num_generated - 1) for r in reqs]

    def _base_tokens(self) -> int:
        """The next step's tokens without drafts, as the scheduler will likely lay them out:
        every running request's uncomputed tokens, then waiting prompts, in the budget."""
        sched = self.scheduler
        base = sum(r.num_tokens - r.num_computed_tokens for r in sched.running)
        base += sum(r.num_tokens - r.num_computed_tokens for r in sched.waiting)
        return max(1, min(base, self.args.max_num_batched_tokens))

    def _propose_drafts(self) -> None:
        """Ask the drafter for each decoding request's next drafts (``Request.draft_tokens``).
        Penalties apply per output position in a verify (each row counts the drafts before
        it), so requests with penalties draft too."""
        for r in self.scheduler.running:
            r.draft_tokens = []
        reqs = self._decoding()
        room = self._draft_room(reqs)
        t0 = time.perf_counter()
        proposals = self.drafter.propose(reqs, room)  # type: ignore[union-attr]
        for r, drafts in zip(reqs, proposals):
            r.draft_tokens = drafts
        self.spec_stats.draft_seconds += time.perf_counter() - t0  # type: ignore[union-attr]
        if self.budget is not None:
            able = [(r, k) for r, k in zip(reqs, room) if k > 0]
            kept = self.budget.choose([r for r, _ in able], self._base_tokens(),
                                      [k for _, k in able])
            self.spec_stats.budget_tokens += sum(kept)  # type: ignore[union-attr]

    def _generating(self) -> list[Request]:
        """Running requests with output tokens (with a step in flight, a decoding request's
        next token is pending: ``_decoding`` does not list it)."""
        return [r for r in self.scheduler.running if r.num_output_tokens]

    def _shadow_round(self) -> None:
        """Coasting (``speculative.adaptive``): shadow proposals that learn acceptance unverified."""
        def candidates() -> tuple[list[Request], list[int]]:
            reqs = self._generating()
            return reqs, self._draft_room(reqs)

        t0 = time.perf_counter()
        self.budget.shadow_round(self.drafter, candidates)  # type: ignore[union-attr]
        self.spec_stats.draft_seconds += time.perf_counter() - t0  # type: ignore[union-attr]
        self.spec_stats.coast_steps += 1  # type: ignore[union-attr]

    def _delta(self, req: Request, delta: RequestDelta) -> RequestDelta:
        if delta.finished:
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

    def update_weights(self, source: Any, target: str = "model") -> Any:
        """Copy new weights (a checkpoint directory or ``(name, tensor)`` pairs) into the
        model's (``target="draft"``: the draft model's) buffers in place, all checked first
        (``model.weight_update``); a model update drops the prefix cache (old-weight KV)."""
        if target not in ("model", "draft"):
            raise ValueError(f"update_weights: target={target!r} is invalid: 'model' or 'draft'")
        if target == "draft":
            runner = getattr(self.drafter, "runner", None)
            if runner is None:
                raise ValueError("update_weights(target='draft') needs a draft model "
                                 "(speculative_config method 'draft_model')")
            return runner.update_weights(source)
        result = self.runner.update_weights(source)
        self.block_manager.drop_cached_blocks([*self.scheduler.running, *self.scheduler.waiting])
        return result

    def detokenized_text(self, request_id: str) -> str:
        """Text released so far for a running request (sibling 0 with n > 1)."""
        group = self.requests.get(request_id)
        state = self.outputs.get(group[0]) if group else None
        return state.text[: state.stop.sent] if state is not None else ""


def sibling_seed(seed: int, index: int) -> int:
    """Sibling ``index``'s seed: sibling 0 keeps the request's seed (so ``n=1`` and the first of
    ``n`` agree); the others get distinct streams derived from ``(seed, index)``."""
    if index == 0:
        return seed
    return (seed + index * 0x9E3779B97F4A7C15) % 2**63


def validate_features(params: SamplingParams, args: EngineArgs, vocab_size: int,
                      has_tokenizer: bool) -> None:
    """Engine-dependent limits of a request's sampling settings."""
    if params.stop and not has_tokenizer:
        raise ValueError("SamplingParams.stop needs a tokenizer (this engine runs on token ids): "
                         "use stop_token_ids")
    if len(params.stop) > args.max_stop_strings:
        raise ValueError(f"SamplingParams.stop=<{len(params.stop)} strings> is invalid: at most "
                         f"EngineArgs.max_stop_strings={args.max_stop_strings} stop strings")
    longest = max(params.stop, key=len, default="")
    if len(longest) > args.max_stop_string_length:
        raise ValueError(f"SamplingParams.stop=<a string of {len(longest)} characters> is "
                         f"invalid: stop strings may have at most "
                         f"EngineArgs.max_stop_string_length={args.max_stop_string_length} "
                         "characters")
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(params, name)
        if k is not None and k > args.max_logprobs:
            raise ValueError(f"SamplingParams.{name}={k} is invalid: must be <= "
                             f"EngineArgs.max_logprobs={args.max_logprobs}")
    bad = [t for t in (params.logit_bias or {}) if t >= vocab_size]
    if bad:
        raise ValueError(f"SamplingParams.logit_bias={params.logit_bias!r} is invalid: token id "
                         f"{bad[0]} is outside the vocabulary [0, {vocab_size})")


__all__ = ["EngineCore", "RequestStatus"]
