"""Per-request grammar state and the per-slot token masks of one engine.

Each constrained request holds an xgrammar ``GrammarMatcher`` (``Request.grammar``). For a
step that samples it, ``prepare`` fills the matcher's next-token bitmask on the host
(xgrammar's ``fill_next_token_bitmask``) into the request's slot row and copies that row into
the graphs' static ``token_bitmask`` buffer; the slot's ``bitmask_on`` flag says the row
applies. The step's tail (``graphs.whole``: mask, then the samples) applies it to the row's logits
before they are sampled, so constrained steps replay graphs like any other.

**A step in two halves.** A step that samples a constrained request (``in_step``) runs its
forward before its masks exist: ``begin`` (before the step's first device operation) sets the
slot flags of newly slotted requests; the model runner then launches the forward (the step
graph applies no masks), and only then does the engine wait for the step in flight, let the
grammars take its tokens (``advance``) and fill the masks (``prepare``), while the device
runs the forward; the step's tail, launched after that, masks the rows and samples them (``EngineCore.launch``, ``ModelRunner.execute``'s ``on_forward``). Steps that
sample no constrained request run ``begin`` alone (slot flags) and the step graph alone.

**Overlap rule.** A mask for step N+1 depends on the token step N samples, and with overlap
scheduling step N+1 is scheduled and its forward launched while step N runs: every mask is
filled after the grammar took every earlier token of its request, those of the step in flight
included (its wait comes after N+1's forward is launched). The rest of step N's results
(outputs, stop checks, detokenizing) is applied after the launch as usual. Steps that sample
no constrained request overlap as usual (nothing here runs for them once no constrained
request is left).

**Mask fill.** The rows of a step's constrained requests are filled together by xgrammar's
``BatchGrammarMatcher`` (its threads fill rows in parallel, outside the GIL) and reach the
device in one copy of the slot range they span. A request whose grammar terminated at the
step in flight finishes when that step is applied, so its row allows every token (whatever
it samples is dropped).

**Applying the step in flight meanwhile.** The fill holds no GIL (xgrammar's C++), so while
the engine thread fills, a worker thread applies the step in flight (``alongside``: outputs,
stop checks, detokenizing) and books the next step (``EngineCore.launch``), the host work
that would otherwise follow the tail's launch; the engine thread waits for it before the
tail. The roles are not the other way round: the
engine thread holds the GIL as it enters the fill, whereas a fill started on a worker would
wait for the GIL until the engine thread's apply let go of it (every switch interval, 5 ms),
that is, until the apply ended. One thread at a time runs the engine's Python, so the apply
needs no locks; nothing it does reads a matcher being filled (whether a grammar terminated
is noted when it takes its tokens, in ``advance``, before the fill starts). A step with fewer
than ``StructuredOutputs.apply_beside_rows`` constrained rows fills and applies in turn:
handing the apply to the worker and back costs about what a fill of one to three rows over a
128k vocabulary saves (``benchmarks/structured.py --grammar-host``).

**Speculative decoding.** Constrained requests do not draft (``engine.speculation``): their
steps sample one row each, so one mask row per slot suffices. A verify step's accepted tokens
would all be accepted here (``advance`` walks every emitted token), but drafting under a
grammar would need per-row masks, which this module does not build.

**Tensor and data parallelism.** Each data-parallel rank's engine has its own
``StructuredOutputs``. In a tensor-parallel group only the leader's engine has one: the
followers' flags stay off, and while any flag is on here (``StaticBuffers.bitmask_any``) the
leader's runner sends the group its sampled tokens in place of their own
(``StepInput.tokens_from_leader``), which costs ``[L]`` int64 per step where the masks would
cost ``ceil(V/32)`` int32 per constrained row.

**Termination.** When the grammar is complete only the stop tokens (the model's EOS ids) are
allowed; accepting one terminates the matcher. A request whose matcher terminated is finished
(``finished_by_grammar``) even when EOS would not stop it (``ignore_eos``).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from replaylm.graphs.buffers import StaticBuffers
from replaylm.sampling.bitmask import bitmask_words


class StructuredOutputs:
    """The host side of the masks: matchers' bitmask rows, the slot flags, the accepted tokens.

    ``buffers``: the graphs' static buffers (``graphs.buffers.StaticBuffers``): their
    ``token_bitmask`` and ``bitmask_on`` on the device, and ``bitmask_any``, kept here.
    """

    #: Fewest rows to fill for which the step in flight is applied on the worker meanwhile.
    apply_beside_rows = 4

    def __init__(self, buffers: StaticBuffers, vocab_size: int) -> None:
        self.buffers = buffers
        token_bitmask, bitmask_on = buffers.token_bitmask, buffers.bitmask_on
        self.device_mask, self.device_on = token_bitmask, bitmask_on
        slots = bitmask_on.shape[0]
        pin = token_bitmask.device.type == "cuda"
        self.host_mask = torch.zeros(slots, bitmask_words(vocab_size), dtype=torch.int32,
                                     pin_memory=pin)
        self._on = [0] * slots  # host mirror of bitmask_on
        self._num_on = 0
        self._owner: list[Any] = [None] * slots  # the constrained request a flag is on for
        self.requests: set[Any] = set()  # unfinished constrained requests
        self._batcher: Any = None  # xgrammar.BatchGrammarMatcher, made at the first batch
        self._applier: ThreadPoolExecutor | None = None  # applies while this thread fills
        self._terminated: set[Any] = set()  # requests whose grammar took its stop token

    @property
    def busy(self) -> bool:
        """Whether any request is constrained or any slot flag is still on (``prepare`` runs
        only then: unconstrained traffic pays nothing here)."""
        return bool(self.requests) or self._num_on > 0

    def add(self, req: Any, matcher: Any) -> None:
        req.grammar = matcher
        self.requests.add(req)

    def release(self, req: Any) -> None:
        """``req`` finished: forget its matcher and turn its slot's flag off (stream-ordered
        after every launched step that sampled it; ``prepare`` also catches any missed)."""
        if req.grammar is None:
            return
        self.requests.discard(req)
        self._terminated.discard(req)
        for slot, owner in enumerate(self._owner):  # its slot may be released already
            if owner is req:
                self._set_flag(slot, None)

    def in_step(self, out: Any) -> bool:
        """Whether step ``out`` samples a constrained request: its masks need the grammar
        state after the step in flight, so they are filled while its forward runs."""
        if not self.requests:
            return False
        return any(s.sample and s.request.grammar is not None for s in out.scheduled)

    def begin(self, out: Any) -> None:
        """Before step ``out``'s first device operation: the slot flags of newly slotted
        requests (stream-ordered with the step)."""
        done = [r for r in self.requests if r.is_finished]
        for req in done:
            self.requests.discard(req)
            self._terminated.discard(req)
        for slot, owner in enumerate(self._owner) if done else ():
            if owner is not None and owner.is_finished:  # its slot is free (or newly taken)
                self._set_flag(slot, None)
        for req in out.newly_slotted:
            self._set_flag(req.slot, req if req.grammar is not None else None)

    def prepare(self, out: Any, alongside: Callable[[], None] | None = None) -> None:
        """The mask row of every constrained request step ``out`` samples, from its grammar's
        current state, copied to the device (stream-ordered after the step's forward, before
        its tail). ``begin`` ran for the step before. ``alongside``: host work run on a
        worker thread while this one fills the rows (it must not touch a matcher)."""
        matchers, slots = [], []
        for s in out.scheduled:
            req = s.request
            if not s.sample or req.grammar is None:
                continue
            if req.grammar.is_terminated():  # finishes when the step in flight is applied
                self.host_mask[req.slot].fill_(-1)
            else:
                matchers.append(req.grammar)
                slots.append(req.slot)
        if alongside is None or len(matchers) < self.apply_beside_rows:
            self._fill(matchers, slots)
            if alongside is not None:
                alongside()
        else:
            if self._applier is None:
                self._applier = ThreadPoolExecutor(1, thread_name_prefix="replaylm-apply")
            applying = self._applier.submit(alongside)
            try:
                self._fill(matchers, slots)  # no GIL held: the worker's Python runs meanwhile
            finally:
                applying.result()
        rows = self._rows(out)
        if rows:
            lo, hi = min(rows), max(rows) + 1
            self.device_mask[lo:hi].copy_(self.host_mask[lo:hi], non_blocking=True)

    def _fill(self, matchers: list[Any], slots: list[int]) -> None:
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(self.host_mask, slots[0])
        elif matchers:
            self._batch().batch_fill_next_token_bitmask(matchers, self.host_mask, slots)

    @staticmethod
    def _rows(out: Any) -> list[int]:
        """Slots of the constrained requests step ``out`` samples."""
        return [s.request.slot for s in out.scheduled
                if s.sample and s.request.grammar is not None]

    def _batch(self) -> Any:
        if self._batcher is None:
            import xgrammar

            self._batcher = xgrammar.BatchGrammarMatcher("auto")
        return self._batcher

    def _set_flag(self, slot: int, owner: Any) -> None:
        """Flag ``slot`` on for constrained request ``owner``, or off (``None``)."""
        self._owner[slot] = owner
        on = int(owner is not None)
        if self._on[slot] != on:
            self._on[slot] = on
            self._num_on += 1 if on else -1
            self.buffers.bitmask_any = self._num_on > 0
            self.device_on[slot: slot + 1].fill_(on)

    def advance(self, out: Any, sampled: list[int]) -> list[tuple[Any, Exception]]:
        """Accept each constrained request's tokens of a resolved step (every token a verify
        emitted, in order); returns the requests whose token the grammar refused."""
        failed = []
        row = 0
        for s in out.scheduled:
            if not s.sample:
                continue
            rows = sampled[row: row + len(s.drafts) + 1]
            row += len(s.drafts) + 1
            req = s.request
            if req.grammar is None or req.is_finished:
                continue
            for token in rows:
                if token < 0:
                    break
                if req.grammar.is_terminated():
                    break  # tokens after the grammar's end are the stop checks' business
                if not req.grammar.accept_token(token):
                    failed.append((req, ValueError(
                        f"token {token} does not continue the request's structured output")))
                    break
            if req.grammar.is_terminated():
                self._terminated.add(req)
        return failed

    def finished_by_grammar(self, req: Any) -> bool:
        """A running request whose grammar has terminated (it accepted a stop token, as
        ``advance`` noted)."""
        return not req.is_finished and req in self._terminated
