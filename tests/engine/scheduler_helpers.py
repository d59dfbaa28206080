"""A fake model for the scheduler tests that reads a simulated paged KV cache, and a driver.

The fake model's next token depends on the request's seed and on every context token it reads
back through the block table, so a token computed into the wrong slot, a block freed while in
use, or a lost/duplicated output changes the outputs against a plain-Python reference.
"""

from __future__ import annotations

from replaylm.batch import BLOCK_SIZE
from replaylm.engine.block_manager import BlockManager
from replaylm.engine.request import Request, RequestStatus
from replaylm.engine.scheduler import Scheduler, SchedulerOutput
from replaylm.sampling_params import SamplingParams


def next_token(seed: int, context: list[int]) -> int:
    return (seed + len(context) + 7 * sum(context)) % 1000


def make_req(rid: str, prompt_len: int, max_tokens: int = 8, seed: int = 0, **kw) -> Request:
    prompt = [(seed * 13 + i) % 500 + 1 for i in range(prompt_len)]
    eos = kw.pop("eos", ())
    return Request(
        rid, prompt, SamplingParams(**kw), 0, seed, eos_token_ids=eos, max_tokens=max_tokens
    )


def reference_output(req: Request, max_model_len: int) -> list[int]:
    """What the request must produce, computed without any scheduler or cache."""
    ctx, out = list(req.prompt_token_ids), []
    stops = set(req.sampling_params.stop_token_ids)
    if not req.sampling_params.ignore_eos:
        stops |= set(req.eos_token_ids)
    while True:
        tok = next_token(req.seed, ctx)
        ctx.append(tok)
        out.append(tok)
        if tok in stops or len(out) >= req.max_tokens or len(ctx) >= max_model_len:
            return out


class FakeRunner:
    """Writes (request, position, token) into KV slots and samples from what it reads back.

    Like the real runner it keeps each request's newest sample on its "device" (``last``): a
    pending token (overlap scheduling) is read from there, never from the host. Blocks of a
    request that is still in a launched step must not be handed to another request.
    """

    def __init__(self, bm: BlockManager) -> None:
        self.bm = bm
        self.kv: dict[int, tuple[str, int, int]] = {}
        self.last: dict[str, int] = {}

    def run(self, out: SchedulerOutput) -> list[int]:
        for s in out.scheduled:  # every layer writes the step's K/V before attention reads
            r = s.request
            assert s.start == r.num_computed_tokens
            for pos in range(s.start, s.start + s.num_new_tokens):
                slot = self.bm.slot(r, pos)
                assert slot >= BLOCK_SIZE, f"{r!r} writes scratch block 0"
                tok = r.token_at(pos) if pos < r.num_known_tokens else self.last[r.request_id]
                self.kv[slot] = (r.request_id, pos, tok)
        sampled = []
        for s in out.scheduled:
            if s.sample:
                r = s.request
                ctx = []
                for pos in range(r.num_tokens):
                    rid, p, tok = self.kv[self.bm.slot(r, pos)]
                    assert (rid, p) == (r.request_id, pos), f"{r!r} reads {rid}@{p} at {pos}"
                    ctx.append(tok)
                sampled.append(next_token(r.seed, ctx))
                self.last[r.request_id] = sampled[-1]
        return sampled


def step_sync(sched: Scheduler, out: SchedulerOutput, runner: FakeRunner) -> list[Request]:
    """Launch ``out`` and resolve it at once (no overlap)."""
    sampled = runner.run(out)
    sched.launched(out)
    return sched.update(out, sampled)


def check_in_flight_blocks_not_free(sched: Scheduler, blocks: set[int]) -> None:
    """No block a launched, unresolved step was given is back in the free pool (where the next
    step could hand it to another request while the launched one still writes it)."""
    freed = blocks & set(sched.block_manager._free)
    assert not freed, f"blocks {sorted(freed)} of the in-flight step are free"


def check_step(sched: Scheduler, out: SchedulerOutput) -> None:
    assert out.num_batched_tokens <= sched.max_num_batched_tokens
    assert len(out.scheduled) <= sched.max_num_seqs
    assert len({id(s.request) for s in out.scheduled}) == len(out.scheduled)
    for s in out.scheduled:
        r = s.request
        assert r.status is RequestStatus.RUNNING and 0 <= r.slot < sched.max_num_seqs
        assert s.num_new_tokens >= 1 and s.start + s.num_new_tokens <= r.num_tokens
        assert s.sample == (s.start + s.num_new_tokens == r.num_tokens)
        assert len(r.block_ids) * BLOCK_SIZE >= s.start + s.num_new_tokens
        if not sched.enable_chunked_prefill:
            assert s.sample, "a prefill was split with chunking disabled"
    for r in out.newly_slotted:
        assert r in [s.request for s in out.scheduled]
    for r in out.preempted:
        assert r.slot == -1 and r.block_ids == [] and r.num_computed_tokens == 0


def drive(
    sched: Scheduler, arrivals: list[tuple[int, Request]], max_steps: int = 20_000,
    overlap: bool = False,
) -> list[SchedulerOutput]:
    """Run to completion, adding each request at its arrival step; checks every step.

    With ``overlap`` each step is resolved only after the next one was scheduled and launched,
    as the engine does with overlap scheduling.
    """
    runner = FakeRunner(sched.block_manager)
    pending = sorted(arrivals, key=lambda a: a[0])
    outs, step = [], 0
    inflight: tuple[SchedulerOutput, list[int]] | None = None
    while pending or sched.has_unfinished or inflight is not None:
        while pending and pending[0][0] <= step:
            sched.add(pending.pop(0)[1])
        out = sched.schedule()
        check_step(sched, out)
        launched = None
        if not out.is_empty:
            launched = (out, runner.run(out))
            sched.launched(out)
            outs.append(out)
            blocks = {b for s in out.scheduled for b in s.request.block_ids}
        else:
            assert inflight is not None or not sched.has_unfinished, "stalled with work left"
        if overlap:
            resolve, inflight = inflight, launched
        else:
            resolve = launched
        if resolve is not None:
            sched.update(*resolve)
        # Resolving may finish requests that the step still in flight uses.
        if overlap and launched is not None:
            check_in_flight_blocks_not_free(sched, blocks)
        sched.check_integrity()
        step += 1
        assert step < max_steps, "did not finish"
    bm = sched.block_manager
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == bm.num_blocks - 1
    return outs


def make_sched(num_blocks: int = 1000, **kw) -> Scheduler:
    args = {"max_num_seqs": 64, "max_num_batched_tokens": 4096, "max_model_len": 512} | kw
    return Scheduler(BlockManager(num_blocks), **args)
