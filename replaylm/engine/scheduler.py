"""The scheduler: one token budget per step, chunked prefill mixed with decode, preemption by
recompute (vLLM V1 style).

Each step gives a request a contiguous run ``[num_computed_tokens, num_computed_tokens + n)`` of
its known tokens (prompt + outputs so far). Decode, the rest of a prefill and a recompute after
preemption are the same thing: tokens whose K/V are not in the cache yet. When the run reaches
the last known token, the step samples one new token for that request.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Collection, Sequence

from replaylm.engine.block_manager import BlockManager
from replaylm.engine.request import Request, RequestStatus
from replaylm.engine.step_plan import ScheduledRequest, SchedulerOutput

__all__ = ["ScheduledRequest", "Scheduler", "SchedulerOutput"]


class Scheduler:
    """FCFS scheduler over one token budget per step.

    Running requests are served first, in admission order; then waiting requests are admitted
    FCFS while slots, budget and blocks allow, never overtaking a request that does not fit.
    When the pool runs out, the most recently admitted running request is preempted: its blocks
    are freed and it goes back to the front of the queue to be recomputed from scratch.

    With chunked prefill, a step in which some running request decodes carries at most
    ``max_mixed_prefill_tokens`` prompt tokens (0: the whole budget), so the prefills of
    new requests spread over the decode steps instead of making a few steps many times
    longer than the rest; a step with nothing to decode fills the whole budget.

    A request whose LoRA adapter is not in a device slot yet is passed over (it keeps its
    place) while the ones behind it are admitted (``adapters``).
    """

    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        max_mixed_prefill_tokens: int = 0,
    ) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1 or max_model_len < 1:
            raise ValueError(
                f"Scheduler needs max_num_seqs, max_num_batched_tokens and max_model_len >= 1, "
                f"got {max_num_seqs}, {max_num_batched_tokens}, {max_model_len}"
            )
        if not enable_chunked_prefill and max_num_batched_tokens < max_model_len:
            # Unsplit prefills of up to max_model_len - 1 tokens must fit one step, or they
            # would wait forever.
            raise ValueError(
                f"without chunked prefill, max_num_batched_tokens ({max_num_batched_tokens}) "
                f"must be >= max_model_len ({max_model_len})"
            )
        usable = block_manager.num_blocks - 1
        if block_manager.blocks_for(max_model_len) > usable:
            # A lone request must always fit the pool, or preemption could not make progress.
            raise ValueError(
                f"max_model_len={max_model_len} needs "
                f"{block_manager.blocks_for(max_model_len)} KV blocks but the pool has {usable}"
            )
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.max_mixed_prefill_tokens = max_mixed_prefill_tokens
        self.running: list[Request] = []
        self.waiting: deque[Request] = deque()
        # Min-heap: the lowest free slot is reused first, keeping slot ids compact.
        self._free_slots: list[int] = list(range(max_num_seqs))
        self._unfinished: dict[str, Request] = {}
        # Finished while in flight: blocks and slot are released when their last step resolves.
        self._parked: list[Request] = []
        # Called with every request whose blocks and slot are released (finish, abort,
        # preemption): state kept beside them (a draft model's KV) goes with them.
        self.on_release: Callable[[Request], None] | None = None
        # LoRA (``lora.manager.LoRAManager``): a waiting request is admitted only once its
        # adapter sits in a device slot (``ready``), and holds the slot while running.
        self.adapters = None

    @property
    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def unfinished_ids(self):
        """Ids of the requests queued or running (a live view)."""
        return self._unfinished.keys()

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def add(self, req: Request) -> None:
        """Queue ``req`` (FCFS). Prompt validation is the engine's job."""
        assert req.num_prompt_tokens >= 1, f"{req.request_id!r} has an empty prompt"
        assert req.request_id not in self._unfinished, f"duplicate request id {req.request_id!r}"
        req.status = RequestStatus.WAITING
        self._unfinished[req.request_id] = req
        self.waiting.append(req)

    def abort(self, request_id: str) -> Request | None:
        """Abort a waiting or running request; ``None`` if unknown or already finished."""
        req = self._unfinished.get(request_id)
        if req is None:
            return None
        self.finish(req, RequestStatus.FINISHED_ABORTED)
        return req

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Finish ``req`` with ``status``: free its blocks and slot, drop it from the queues."""
        assert status.finished, f"finish() needs a finished status, got {status}"
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if req.inflight:
            self._parked.append(req)  # a launched step still reads its blocks and slot
        else:
            self._release(req)
        req.status = status
        self._unfinished.pop(req.request_id, None)

    def schedule(self, hold: Collection[Request] = ()) -> SchedulerOutput:
        """The next step. ``hold``: running requests that sit this step out (pipelined verify
        steps, ``speculative.pipeline``: the cohort in flight, and any ready request beyond
        this step's cohort)."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        prefill_room = self._prefill_room(hold)
        bm = self.block_manager

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if (req.num_pending and self._finishes_on_resolve(req)) or req in hold:
                i += 1  # its last token is in flight (nothing more to compute), or held
                continue
            n = req.num_tokens - req.num_computed_tokens
            assert n >= 1, f"{req!r} is running with nothing to compute"
            limit = budget if n == 1 else min(budget, prefill_room)
            if n > limit:
                if not self.enable_chunked_prefill or limit == 0:
                    i += 1  # an unsplittable prefill waits; later decodes may still fit
                    continue
                n = limit
            drafts = self._drafts(req, n, budget)
            if drafts and not bm.allocate(req, req.num_computed_tokens + n + len(drafts)):
                drafts = []  # drafts never preempt anyone: verify without them
            n += len(drafts)
            while not bm.allocate(req, req.num_computed_tokens + n):
                victim = self.running[-1]
                if victim.inflight:
                    out.blocked = True  # its blocks are in use by the step in flight
                    break
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            if out.blocked or req.status is not RequestStatus.RUNNING:
                break  # blocked, or req was the last running request and preempted itself
            out.scheduled.append(self._scheduled(req, n, drafts))
            budget -= n
            if n > 1 + len(drafts):
                prefill_room -= n
            i += 1

        # After a preemption the pool is tight: admitting now would only evict again next step.
        head = 0  # requests before it wait for their LoRA adapter's slot
        while head < len(self.waiting) and budget > 0 and self._free_slots \
                and not out.preempted and not out.blocked:
            req = self.waiting[head]
            if self._waits_for_leader(req):
                break  # FCFS: nothing overtakes it, and the leader's prefill is under way
            if self.adapters is not None and not self.adapters.ready(req):
                head += 1  # its adapter is not in a slot yet: the requests behind go on
                continue
            hit = self._reuse_prefix(req)
            n = req.num_tokens - req.num_computed_tokens
            limit = budget if n == 1 else min(budget, prefill_room)
            if n > limit:
                if not self.enable_chunked_prefill or limit == 0:
                    bm.free(req)  # give reused blocks back (they stay cached)
                    req.num_computed_tokens = 0
                    break
                n = limit
            if not bm.allocate(req, req.num_computed_tokens + n):
                bm.free(req)
                req.num_computed_tokens = 0
                break
            bm.record_query(req, hit)
            del self.waiting[head]
            if self.adapters is not None:
                self.adapters.hold(req)
            req.slot = heapq.heappop(self._free_slots)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.newly_slotted.append(req)
            out.scheduled.append(self._scheduled(req, n))
            budget -= n
            if n > 1:
                prefill_room -= n
        return out

    def _prefill_room(self, hold: Collection[Request]) -> int:
        """Prompt tokens this step may carry: ``max_mixed_prefill_tokens`` when a running
        request will decode in it (chunked prefill on), else the whole budget."""
        cap = self.max_mixed_prefill_tokens
        if not cap or not self.enable_chunked_prefill:
            return self.max_num_batched_tokens
        decoding = any(r.num_tokens - r.num_computed_tokens == 1
                       and not (r.num_pending and self._finishes_on_resolve(r))
                       and r not in hold
                       for r in self.running)
        return min(cap, self.max_num_batched_tokens) if decoding else self.max_num_batched_tokens

    def launched(self, out: SchedulerOutput) -> None:
        """The step ``out`` was launched: advance computed counts, add pending samples."""
        for s in out.scheduled:
            req = s.request
            assert req.num_computed_tokens == s.start, f"{req!r} moved since scheduled at {s.start}"
            req.num_computed_tokens += s.num_new_tokens
            req.inflight += 1
            if s.num_new_tokens > 1:  # a prompt chunk: its known tokens can be matched at once
                self.block_manager.register(req)  # (a hit runs after this step on the device)
            if s.sample:
                req.num_pending += 1

    def update(self, out: SchedulerOutput, sampled: Sequence[int]) -> list[Request]:
        """Resolve a launched step with its samples; returns the requests that got a token or
        finished. Steps resolve in launch order."""
        if len(sampled) != out.num_sampled:
            raise ValueError(
                f"update: got {len(sampled)} sampled tokens, expected {out.num_sampled}"
            )
        changed: list[Request] = []
        row = 0
        for s in out.scheduled:
            # Consume rows in order even when skipping. A verify's rows past the emitted ones
            # hold -1 (``speculative.acceptance``): its rejected drafts' K/V are rolled back below.
            emitted: list[int] = []
            if s.sample:
                k = len(s.drafts)
                emitted = [t for t in sampled[row: row + k + 1] if t >= 0]
                row += k + 1
            token = emitted[0] if emitted else None
            req = s.request
            req.inflight -= 1
            if s.sample:
                req.num_pending -= 1
                if s.drafts:  # keep the K/V of the accepted drafts only
                    req.num_computed_tokens -= len(s.drafts) - (len(emitted) - 1)
            if req.status is not RequestStatus.RUNNING:
                if req.inflight == 0 and req in self._parked:
                    self._parked.remove(req)
                    self._release(req)
                continue  # finished or aborted while the step ran: its sample is dropped
            self.block_manager.register(req)  # before any finish frees (and caches) the blocks
            if token is None:
                continue
            for token in emitted:  # a stop inside an accepted run ends the request there
                req.output_token_ids.append(token)
                status = self._stop_status(req, token)
                if status is not None:
                    self.finish(req, status)
                    break
            changed.append(req)
        return changed

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    @property
    def holders(self) -> list[Request]:
        """Every request that may hold KV blocks: running, waiting (a prefix-cache match or a
        preempted one's) and finished ones a launched step still reads (parked)."""
        return [*self.running, *self.waiting, *self._parked]

    def check_integrity(self) -> None:
        """Check slots, statuses and the block pool against the queues (tests, debugging)."""
        slots = [r.slot for r in self.running + self._parked]
        assert len(self.running) <= self.max_num_seqs, f"{len(self.running)} running > max"
        assert len(set(slots)) == len(slots), f"duplicate slots among running: {slots}"
        assert all(0 <= s < self.max_num_seqs for s in slots), f"slot out of range: {slots}"
        assert not set(slots) & set(self._free_slots), "a running slot is also free"
        assert len(slots) + len(self._free_slots) == self.max_num_seqs, "slots leaked"
        for r in self._parked:
            assert r.inflight > 0 and r.status.finished, f"{r!r} parked but not in flight"
        for r in self.running:
            assert r.status is RequestStatus.RUNNING, f"{r!r} in running"
        for r in self.waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), f"{r!r} waiting"
            assert r.slot == -1, f"waiting {r!r} holds a slot"
        self.block_manager.check_integrity([*self.running, *self.waiting, *self._parked])

    def _scheduled(self, req: Request, n: int, drafts: list[int] | None = None
                   ) -> ScheduledRequest:
        start = req.num_computed_tokens
        drafts = drafts or []
        return ScheduledRequest(req, n, start, sample=start + n - len(drafts) == req.num_tokens,
                                drafts=drafts)

    def _drafts(self, req: Request, n: int, budget: int) -> list[int]:
        """The drafts ``req`` verifies this step: only on a decode step (one token to
        compute), within the token budget, and never past ``max_tokens`` or
        ``max_model_len`` (the verify emits up to ``k + 1`` tokens)."""
        if n != 1 or not req.draft_tokens or req.num_pending:
            return []
        k = min(len(req.draft_tokens), budget - 1, req.max_tokens - req.num_generated - 1,
                self.max_model_len - req.num_tokens - 1)
        return req.draft_tokens[:k] if k > 0 else []

    @staticmethod
    def _waits_for_leader(req: Request) -> bool:
        """An n > 1 sibling waits until its leader has computed the prompt, then shares it."""
        leader = req.leader
        return (leader is not None and leader.status is RequestStatus.RUNNING
                and leader.num_computed_tokens < leader.num_prompt_tokens)

    def _reuse_prefix(self, req: Request) -> int:
        """Start ``req`` on already computed blocks (prefix cache, or its n > 1 leader's)."""
        bm = self.block_manager
        if req.prompt_logprobs_k is not None \
                and len(req.prompt_logprobs) < req.num_prompt_tokens - 1:
            return 0  # every prompt position must run to score it
        if bm.cache is not None:
            return bm.match_prefix(req)
        leader = req.leader
        if leader is not None and leader.status is RequestStatus.RUNNING:
            return bm.share(leader, req)
        return 0

    def _finishes_on_resolve(self, req: Request) -> bool:
        """Whether a pending sample will end ``req`` by length (so nothing follows it)."""
        return req.num_generated >= req.max_tokens or req.num_tokens >= self.max_model_len

    def _preempt(self, req: Request) -> None:
        # Recompute, not swap: the request keeps its outputs and recomputes all known tokens.
        self.running.remove(req)
        self._release(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)

    def _release(self, req: Request) -> None:
        if self.on_release is not None:
            self.on_release(req)
        self.block_manager.free(req)
        if self.adapters is not None:
            self.adapters.release(req)
        if req.slot >= 0:
            heapq.heappush(self._free_slots, req.slot)
            req.slot = -1

    def _stop_status(self, req: Request, token: int) -> RequestStatus | None:
        params = req.sampling_params
        stop_token = (token in req.eos_token_ids and not params.ignore_eos) \
            or token in params.stop_token_ids
        if stop_token and req.num_output_tokens > params.min_tokens:
            # vLLM's convention: EOS leaves stop_reason None, a stop token id is reported.
            req.stop_reason = token if token in params.stop_token_ids else None
            return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.max_tokens or req.num_known_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
