"""The ``draft_model`` drafter: a second, smaller model sharing the target's vocabulary drafts
each request's next tokens autoregressively, on its own KV pool and its own graphs.

Each engine step, ``propose`` runs the draft model on every drafted request at once:

1. catch-up: the known tokens the draft KV does not hold yet (the prompt and first output
   the first time; after a verify, the bonus token and an accepted draft not fed yet) run as
   one front-packed batch, chunked to ``max_num_batched_tokens`` as prefill is; its last row
   per request samples draft 0;
2. decode steps 1 .. K-1, every request with room batched in each, feeding the previous draft
   from the device (``last_token``) and sampling the next.

Draft ``j`` of a request is drawn at output position ``num_generated + j`` from ``q``, the
distribution the request's sampling settings give the draft's logits (``sampling_probs``):
its argmax for a greedy request, a counter-based draw (keyed by seed and position) otherwise.
A request's drafts stop before the first whose top-token probability is below
``draft_confidence``, and never pass ``max_tokens`` or ``max_model_len``. Cutting at the
confidence needs the probabilities on the host, so every request runs the steps its room
allows and one copy at the end brings drafts and confidences back.

Rollback by lengths: after a verify, the draft KV stays valid for the known tokens up to where
the drafts fed into it stop matching what the target emitted (``DraftSeq.sync``); the next
catch-up overwrites the rest. The draft KV of a request is freed whenever the scheduler
releases the request's own blocks (finish, abort, preemption).

Acceptance (``acceptance``): a greedy request's drafts take the engine's exact-match path
(longest matching prefix, then the bonus token). A sampling request's draft rows are replaced
by ``rejection_sample`` of the target's distribution ``p`` against the stored ``q``: accepted
with probability min(1, p/q), else a draw from the residual; its bonus row is sampled as
plain decoding samples it. Everything after ``propose``'s copy runs on the device.

Under tensor parallel the draft model runs unsharded on the group's leader alone (no
collectives); the leader broadcasts the tokens its acceptance kept to the other ranks
(``ModelRunner.execute``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from replaylm.engine.block_manager import BlockManager
from replaylm.engine.draft_runner import DraftModelRunner
from replaylm.engine.packing import build_host_batch
from replaylm.engine.request import Request
from replaylm.engine.scheduler import ScheduledRequest, SchedulerOutput
from replaylm.sampling.sampler import SamplingState, draw, sampling_probs
from replaylm.speculative.acceptance import rejection_sample
from replaylm.speculative.config import SpecConfig

_DRAFT_SALT = 0x2545F491  # separates the draft's sampling stream from the target's

class DraftSeq:
    """A request in the draft model's KV pool, shaped as packing (``engine.packing``) and the
    block manager read a request: its tokens known on the host when drafting began are its
    "prompt", the drafts sampled on the device since are its pending tokens."""

    def __init__(self, req: Request) -> None:
        self.req = req
        self.request_id = req.request_id
        self.slot = req.slot  # the draft runner's per-slot state uses the request's slot
        self.block_ids: list[int] = []
        self.block_hashes: list = []
        self.table_len = 0
        self.device_token_slot = -1
        self.num_computed_tokens = 0  # leading positions whose draft K/V are written
        self.num_prompt_tokens = 0
        self.num_pending = 0
        self.fed: list[int] = []  # drafts written after the known tokens, in order
        self.lora_slot = -1  # the draft model runs without the request's LoRA adapter

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_pending

    @property
    def num_generated(self) -> int:
        return self.req.num_generated + self.num_pending

    def token_slice(self, start: int, end: int) -> list[int]:
        known = self.num_prompt_tokens
        if end <= known:
            return self.req.token_slice(start, end)
        return self.req.token_slice(min(start, known), known) + [0] * (end - max(start, known))

    def sync(self) -> int:
        """Start a new proposal from the request's known tokens; returns how many leading
        tokens the draft KV holds for them (at most all but the last, whose logits the
        proposal needs)."""
        base, req = self.num_prompt_tokens, self.req
        known = req.num_tokens
        valid = min(self.num_computed_tokens, base)
        if valid == base:
            for j, t in enumerate(self.fed):
                if base + j >= known or req.token_at(base + j) != t:
                    break
                valid += 1
        self.num_prompt_tokens, self.num_pending, self.fed = known, 0, []
        self.device_token_slot = -1
        return min(valid, known - 1)

class DraftModelDrafter:
    """Proposes drafts with a ``DraftModelRunner`` (see the module docstring); the engine
    wires ``release`` to the scheduler and ``acceptance`` to the target runner."""

    def __init__(self, runner: DraftModelRunner, spec: SpecConfig, target_blocks: int,
                 max_model_len: int, state: SamplingState, stats: Any = None) -> None:
        runner.start(target_blocks)
        self.runner = runner
        self.block_manager = BlockManager(runner.num_blocks)
        self.confidence = spec.draft_confidence
        self.max_model_len = max_model_len
        self.max_tokens = runner.args.max_num_batched_tokens
        self.vocab_size = runner.cfg.vocab_size
        self.stats = stats
        self.state = state  # the target's per-slot sampling settings (slots are shared)
        self.seqs: dict[Request, DraftSeq] = {}
        # The latest proposal's draft distributions (sampling requests only): rows of
        # ``_q`` and, per request, the row of each of its drafts.
        self._q: torch.Tensor | None = None
        self._q_rows: dict[Request, list[int]] = {}
        self._events: list[torch.cuda.Event] = []  # the latest two draft steps (CUDA)
        self._last_fit = True  # whether the latest ran on the static buffers

    # Lifecycle -----------------------------------------------------------------------------

    def release(self, req: Request) -> None:
        """Free ``req``'s draft KV (the scheduler released its own blocks)."""
        seq = self.seqs.pop(req, None)
        if seq is not None:
            self.block_manager.free(seq)
        self._q_rows.pop(req, None)

    def check_integrity(self) -> None:
        self.block_manager.check_integrity(self.seqs.values())

    @property
    def num_used_blocks(self) -> int:
        return self.block_manager.num_used_blocks

    # Proposing -----------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, requests: Sequence[Request], max_lens: Sequence[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in requests]
        self._q, self._q_rows = None, {}
        plan: list[tuple[int, DraftSeq, int]] = []  # (request index, seq, draft steps)
        for i, (req, k) in enumerate(zip(requests, max_lens)):
            room = min(k, self.max_model_len - req.num_tokens - 1)
            if room < 1 or len(plan) >= self.max_tokens:
                continue
            seq = self._seq(req)
            if not self.block_manager.allocate(seq, req.num_tokens + room - 1):
                self.release(req)  # no room: it catches up once the pool has some
                continue
            plan.append((i, seq, room))
        if not plan:
            return drafts
        self._catch_up([seq for _, seq, _ in plan])
        tokens, confs, qs = [], [], []
        q_rows: list[list[int]] = [[] for _ in plan]
        q_count = 0
        for j in range(max(room for _, _, room in plan)):
            active = [p for p, (_, _, room) in enumerate(plan) if room > j]
            batch = [plan[p][1] for p in active]
            sched = [ScheduledRequest(s, s.num_tokens - s.num_computed_tokens,
                                      s.num_computed_tokens, sample=True) for s in batch]
            tok, conf, q, sampled = self._draft_step(sched)
            tokens.append(tok)
            confs.append(conf)
            if q is not None:
                qs.append(q)
                for n, b in enumerate(sampled):
                    q_rows[active[b]].append(q_count + n)
                q_count += len(sampled)
            for s in batch:
                s.num_pending += 1
        tok_host = torch.cat(tokens).tolist()  # the proposal's one wait for the device
        conf_host = torch.cat(confs).tolist()
        by_step: list[list[tuple[int, float]]] = [[] for _ in plan]
        at = 0
        for j in range(len(tokens)):
            for p in (p for p, (_, _, room) in enumerate(plan) if room > j):
                by_step[p].append((tok_host[at], conf_host[at]))
                at += 1
        for p, (i, seq, room) in enumerate(plan):
            seq.fed = [t for t, _ in by_step[p][: room - 1]]
            seq.num_pending = 0
            c = self.confidence
            for t, conf in by_step[p]:
                if c is not None and conf < c:
                    break
                drafts[i].append(t)
            if q_rows[p] and drafts[i]:
                self._q_rows[seq.req] = q_rows[p][: len(drafts[i])]
        if qs:
            self._q = torch.cat(qs)
        return drafts

    def _seq(self, req: Request) -> DraftSeq:
        seq = self.seqs.get(req)
        if seq is None or seq.slot != req.slot:
            if seq is not None:
                self.block_manager.free(seq)
            seq = self.seqs[req] = DraftSeq(req)
        self.block_manager.truncate(seq, seq.sync())
        return seq

    def _catch_up(self, seqs: list[DraftSeq]) -> None:
        """Write the known tokens each draft KV lacks, all but each request's last in
        chunks of at most ``max_num_batched_tokens`` while they do not fit one step; the
        last tokens then run in the proposal's first step."""
        rem = {id(s): s.num_tokens - s.num_computed_tokens for s in seqs}
        while sum(rem.values()) > self.max_tokens:
            take, sched = self.max_tokens, []
            for s in seqs:
                m = min(rem[id(s)] - 1, take)
                if m > 0:
                    sched.append(ScheduledRequest(s, m, s.num_computed_tokens, sample=False))
                    rem[id(s)] -= m
                    take -= m
            self._launch(sched)

    def _launch(self, sched: list[ScheduledRequest]):
        """Run one draft step; returns the graph runtime's result."""
        runner = self.runner
        host = build_host_batch(SchedulerOutput(scheduled=sched), runner.max_blocks_per_req)
        # The static buffers stage inputs in two pinned buffers, alternating per step that
        # runs on them: the step that last copied from the one about to be rewritten must
        # have run (the previous one, after a step too large for them, which does not flip).
        if self._events:
            self._events[-1 if not self._last_fit or len(self._events) < 2 else -2].synchronize()
        runner.buffers.update_block_tables(host)
        res = runner.graphs.run(host)
        for s in sched:
            s.request.num_computed_tokens += s.num_new_tokens
        if runner.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            self._events = self._events[-1:] + [event]
            self._last_fit = runner.buffers.fits(host)
        if self.stats is not None:
            self.stats.draft_forwards += 1
        return res

    def _draft_step(self, sched: list[ScheduledRequest]):
        """One sampling step of the draft model: ``(tokens, confidences, q, sampled)`` with
        ``q`` the distributions of the sampling requests' rows (``sampled``: their indices
        in ``sched``), None when every request is greedy."""
        state = self.state
        res = self._launch(sched)
        n = len(sched)
        slots = res.batch.sample_slots[:n]
        out_pos = res.batch.sample_out_pos[:n]
        host_slots = [s.request.slot for s in sched]
        sampled = [b for b, slot in enumerate(host_slots) if not state.all_greedy([slot])]
        # The draft's tail takes the argmax of every row (``samples_in_tail`` is off).
        greedy = res.samples if res.samples is not None else res.logits.argmax(dim=-1)
        q = None
        if not sampled and self.confidence is None:  # argmax alone: no distribution needed
            tokens, conf = greedy.clone(), torch.ones(n, device=greedy.device)
        else:
            probs = sampling_probs(res.logits, slots, state, state.needs_filter(host_slots))
            conf = probs.max(dim=-1).values
            tokens = greedy.clone()
        if sampled:
            drawn = draw(probs, state.seed_key.index_select(0, slots) ^ _DRAFT_SALT, out_pos,
                         state.vocab_hash(self.vocab_size))
            is_greedy = state.temperature.index_select(0, slots) == 0.0
            tokens = torch.where(is_greedy, greedy, drawn)
            q = probs.index_select(0, torch.tensor(sampled, device=probs.device))
        self.runner.last_token.index_copy_(0, slots, tokens)
        return tokens, conf, q, sampled

    # Acceptance ----------------------------------------------------------------------------

    def acceptance(self, out: SchedulerOutput, state: SamplingState
                   ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
        """The verify's rejection sampling for the draft rows of sampling requests (None
        when the step has none): ``accept(processed logits, sampled tokens) -> tokens``."""
        rows: list[int] = []
        q_rows: list[int] = []
        slots: list[int] = []
        out_pos: list[int] = []
        draft_ids: list[int] = []
        row = 0
        for s in out.scheduled:
            if not s.sample:
                continue
            k = len(s.drafts)
            mine = self._q_rows.get(s.request) if k else None
            if mine:
                req = s.request
                rows += range(row, row + k)
                q_rows += mine[:k]
                slots += [req.slot] * k
                out_pos += range(req.num_generated, req.num_generated + k)
                draft_ids += s.drafts
            row += k + 1
        if not rows or self._q is None:
            return None
        dev = self._q.device

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64).to(dev, non_blocking=True)

        rows_t, q_t, slots_t = tensor(rows), tensor(q_rows), tensor(slots)
        pos_t, drafts_t = tensor(out_pos), tensor(draft_ids)
        q = self._q
        need_filter = state.needs_filter(slots)

        def accept(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
            p = sampling_probs(logits.index_select(0, rows_t), slots_t, state, need_filter)
            _, drawn = rejection_sample(p, q.index_select(0, q_t), drafts_t,
                                        state.seed_key.index_select(0, slots_t), pos_t,
                                        state.vocab_hash(logits.shape[-1]))
            return tokens.index_copy(0, rows_t, drawn)

        return accept
