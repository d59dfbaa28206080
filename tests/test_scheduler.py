"""CPU-only tests of the scheduler, driven by a fake model that reads a simulated paged KV cache.

The fake model's next token depends on the request's seed and on every context token it reads
back through the block table, so a token computed into the wrong slot, a block freed while in
use, or a lost/duplicated output changes the outputs against a plain-Python reference.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replaylm.attention.backend import BLOCK_SIZE
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


def test_overlap_schedules_around_pending_tokens() -> None:
    """Overlap: step N+1 is planned before N's samples arrive; nothing runs past max_tokens."""
    sched = make_sched()
    reqs = [make_req(f"r{i}", 5 + i, max_tokens=4, seed=i) for i in range(3)]
    outs = drive(sched, [(0, r) for r in reqs], overlap=True)
    # Prefill, then 3 decodes; the 4th token's step is never launched (it would be the 5th).
    assert len(outs) == 4
    assert all(s.sample for o in outs for s in o.scheduled)
    for r in reqs:
        assert r.output_token_ids == reference_output(r, 512) and r.num_pending == 0
        assert r.inflight == 0


def test_overlap_stop_lags_one_step_and_parks_blocks() -> None:
    """An EOS seen when step N resolves: the request is already in step N+1, which keeps its
    blocks until it resolves too; its extra sample is dropped."""
    sched = make_sched()
    req = make_req("a", 4, max_tokens=10, eos=(7,))
    sched.add(req)
    out1 = sched.schedule()
    sched.launched(out1)
    out2 = sched.schedule()  # planned around out1's pending token
    assert [(s.start, s.num_new_tokens) for s in out2.scheduled] == [(4, 1)]
    sched.launched(out2)
    assert req.num_pending == 2 and req.inflight == 2
    blocks = list(req.block_ids)
    assert sched.update(out1, [7]) == [req] and req.status is RequestStatus.FINISHED_STOPPED
    assert req.block_ids == blocks and sched.num_parked == 1  # out2 still uses them
    sched.check_integrity()
    assert sched.update(out2, [5]) == []  # finished: the late sample is dropped
    assert req.output_token_ids == [7] and req.block_ids == [] and sched.num_parked == 0
    assert sched.block_manager.num_used_blocks == 0
    sched.check_integrity()


def test_decode_batching() -> None:
    sched = make_sched()
    reqs = [make_req(f"r{i}", 5 + i, max_tokens=4, seed=i) for i in range(4)]
    outs = drive(sched, [(0, r) for r in reqs])
    assert [s.num_new_tokens for s in outs[0].scheduled] == [5, 6, 7, 8]
    assert outs[0].newly_slotted == reqs and [r.slot for r in reqs] == [-1] * 4
    for out in outs[1:]:
        assert [(s.request, s.num_new_tokens, s.sample) for s in out.scheduled] == [
            (r, 1, True) for r in reqs
        ]
    assert len(outs) == 4
    for r in reqs:
        assert r.output_token_ids == reference_output(r, 512)
        assert r.status is RequestStatus.FINISHED_LENGTH


def test_chunked_prefill_splits_and_mixes_with_decode() -> None:
    sched = make_sched(max_num_batched_tokens=16)
    a, b = make_req("a", 3, max_tokens=10), make_req("b", 40, max_tokens=2, seed=1)
    outs = drive(sched, [(0, a), (1, b)])
    steps = [
        [(s.request.request_id, s.start, s.num_new_tokens, s.sample) for s in o.scheduled]
        for o in outs
    ]
    assert steps[0] == [("a", 0, 3, True)]
    assert steps[1] == [("a", 3, 1, True), ("b", 0, 15, False)]
    assert steps[2] == [("a", 4, 1, True), ("b", 15, 15, False)]
    assert steps[3] == [("a", 5, 1, True), ("b", 30, 10, True)]
    assert steps[4] == [("a", 6, 1, True), ("b", 40, 1, True)]
    assert max(o.num_batched_tokens for o in outs) == 16
    assert b.output_token_ids == reference_output(b, 512)


def test_budget_respected_with_long_prompts() -> None:
    sched = make_sched(max_num_batched_tokens=10)
    reqs = [make_req(f"r{i}", 23 + 5 * i, max_tokens=3, seed=i) for i in range(5)]
    outs = drive(sched, [(i, r) for i, r in enumerate(reqs)])
    assert all(o.num_batched_tokens <= 10 for o in outs)
    assert sum(o.num_batched_tokens == 10 for o in outs) > 5
    assert all(r.output_token_ids == reference_output(r, 512) for r in reqs)


def test_without_chunking_a_prefill_waits_whole() -> None:
    sched = make_sched(max_num_batched_tokens=64, max_model_len=64, enable_chunked_prefill=False)
    a, b, c = make_req("a", 4, 5), make_req("b", 4, 5, seed=1), make_req("c", 63, 1, seed=2)
    outs = drive(sched, [(0, a), (0, b), (1, c)])
    c_steps = [
        (i, s.num_new_tokens) for i, o in enumerate(outs) for s in o.scheduled if s.request is c
    ]
    # c (63 tokens) does not fit beside two decodes (2 + 63 > 64): it waits for a and b to finish.
    assert c_steps == [(5, 63)]
    assert c.status is RequestStatus.FINISHED_LENGTH
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make_sched(max_num_batched_tokens=32, max_model_len=64, enable_chunked_prefill=False)


def test_max_num_seqs_and_slots() -> None:
    sched = make_sched(max_num_seqs=3)
    reqs = [make_req(f"r{i}", 4, max_tokens=2 + i % 3, seed=i) for i in range(10)]
    outs = drive(sched, [(0, r) for r in reqs])
    assert max(len(o.scheduled) for o in outs) == 3
    assert [r.request_id for r in outs[0].newly_slotted] == ["r0", "r1", "r2"]
    slotted = [r for o in outs for r in o.newly_slotted]
    assert slotted == reqs  # FCFS admission, each admitted once (no preemption here)


@pytest.mark.parametrize("overlap", [False, True])
def test_preemption_tiny_pool_finishes_everything(overlap: bool) -> None:
    sched = make_sched(num_blocks=6, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=80)
    reqs = [make_req(f"r{i}", 10 + 3 * i, max_tokens=20, seed=i) for i in range(8)]
    outs = drive(sched, [(0, r) for r in reqs], overlap=overlap)
    assert sum(r.num_preemptions for r in reqs) > 0
    assert any(o.preempted for o in outs)
    for r in reqs:
        assert r.num_output_tokens == 20 and r.status is RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == reference_output(r, 80)
        assert r.block_ids == [] and r.slot == -1


def test_preempts_most_recent_and_requeues_at_front() -> None:
    sched = make_sched(num_blocks=4, max_num_batched_tokens=64, max_model_len=48)  # 3 blocks
    a, b, c = make_req("a", 16, 40), make_req("b", 16, 40, seed=1), make_req("c", 5, seed=2)
    for r in (a, b, c):
        sched.add(r)
    runner = FakeRunner(sched.block_manager)
    out = sched.schedule()
    assert [s.request for s in out.scheduled] == [a, b, c] and not out.preempted
    step_sync(sched, out, runner)
    # a needs a 2nd block: c (last admitted) goes; then b needs one and, being last, preempts
    # itself. Both return to the front of the queue, in their admission order.
    out = sched.schedule()
    assert out.preempted == [c, b]
    assert [s.request for s in out.scheduled] == [a]
    assert list(sched.waiting) == [b, c] and c.status is RequestStatus.PREEMPTED
    assert c.slot == -1 and c.num_computed_tokens == 0 and c.num_preemptions == 1
    assert not out.newly_slotted
    step_sync(sched, out, runner)
    sched.check_integrity()


def test_no_admission_in_a_step_that_preempted() -> None:
    # b preempts itself for want of a 2nd block; a 16-token chunk of its recompute would fit the
    # one block it freed, but admitting it now would only evict it again next step.
    sched = make_sched(num_blocks=4, max_num_batched_tokens=17, max_model_len=48)
    a, b = make_req("a", 16, 20), make_req("b", 17, 3, seed=1)
    sched.add(a)
    sched.add(b)
    runner = FakeRunner(sched.block_manager)
    out = sched.schedule()
    assert [(s.request, s.num_new_tokens) for s in out.scheduled] == [(a, 16), (b, 1)]
    step_sync(sched, out, runner)
    out = sched.schedule()
    assert out.preempted == [b] and [s.request for s in out.scheduled] == [a]
    assert not out.newly_slotted and list(sched.waiting) == [b]
    step_sync(sched, out, runner)
    while sched.has_unfinished:
        out = sched.schedule()
        step_sync(sched, out, runner)
        sched.check_integrity()
    assert a.output_token_ids == reference_output(a, 48)
    assert b.output_token_ids == reference_output(b, 48)


def test_abort_waiting_running_and_in_flight() -> None:
    sched = make_sched(num_blocks=20, max_num_seqs=2, max_model_len=64)
    a, b, c = make_req("a", 20), make_req("b", 20, seed=1), make_req("c", 20, seed=2)
    for r in (a, b, c):
        sched.add(r)
    runner = FakeRunner(sched.block_manager)
    out = sched.schedule()
    assert sched.abort("c") is c and c.status is RequestStatus.FINISHED_ABORTED
    assert sched.num_waiting == 0
    sampled = runner.run(out)
    sched.launched(out)
    a_blocks = list(a.block_ids)
    free_before = sched.block_manager.num_free_blocks
    assert sched.abort("a") is a  # aborted while its step is in flight
    # Parked: the launched step still writes a's blocks, so they are not free yet.
    assert a.block_ids == a_blocks and a.slot >= 0 and sched.num_running == 1
    assert sched.num_parked == 1 and sched.block_manager.num_free_blocks == free_before
    sched.check_integrity()
    changed = sched.update(out, sampled)
    assert changed == [b] and b.output_token_ids == sampled[1:]
    assert a.block_ids == [] and a.slot == -1 and sched.num_parked == 0
    assert a.output_token_ids == [] and sched.abort("a") is None and sched.abort("zz") is None
    sched.check_integrity()
    assert sched.block_manager.num_used_blocks == 2
    assert sched.abort("b") is b and not sched.has_unfinished
    assert sched.block_manager.num_used_blocks == 0


@pytest.mark.parametrize(
    ("kw", "tokens", "status", "n_out"),
    [
        ({"eos": (7,)}, [3, 7, 9], RequestStatus.FINISHED_STOPPED, 2),
        ({"eos": (7,), "ignore_eos": True}, [3, 7, 9], RequestStatus.FINISHED_LENGTH, 3),
        ({"stop_token_ids": [9]}, [9, 1, 2], RequestStatus.FINISHED_STOPPED, 1),
        ({"max_tokens": 100}, [1, 2, 3, 4, 5], RequestStatus.FINISHED_LENGTH, 4),  # max_model_len
    ],
)
def test_stop_conditions(kw: dict, tokens: list[int], status: RequestStatus, n_out: int) -> None:
    sched = make_sched(max_model_len=8)
    req = make_req("a", 4, max_tokens=kw.pop("max_tokens", 3), **kw)
    sched.add(req)
    for tok in tokens:
        out = sched.schedule()
        if out.is_empty:
            break
        sched.launched(out)
        assert sched.update(out, [tok]) == [req]
    assert req.status is status and req.output_token_ids == tokens[:n_out]
    assert sched.block_manager.num_used_blocks == 0 and not sched.has_unfinished


def test_update_checks_sample_count_and_add_checks_prompt() -> None:
    sched = make_sched()
    sched.add(make_req("a", 3))
    out = sched.schedule()
    sched.launched(out)
    with pytest.raises(ValueError, match="expected 1"):
        sched.update(out, [])
    with pytest.raises(AssertionError, match="empty prompt"):
        sched.add(make_req("b", 0))
    with pytest.raises(ValueError, match="KV blocks"):
        make_sched(num_blocks=4, max_model_len=49)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_property_random_traffic(data: st.DataObject) -> None:
    max_model_len = data.draw(st.integers(8, 96), label="max_model_len")
    min_blocks = -(-max_model_len // BLOCK_SIZE) + 1
    num_blocks = data.draw(st.integers(min_blocks, min_blocks + 4), label="num_blocks")
    chunked = data.draw(st.booleans(), label="chunked")
    # Tight pools, small budgets and many slots make preemption and split prefills common.
    low = 1 if chunked else max_model_len  # unsplit prefills must fit one step
    budget = data.draw(st.integers(low, low + 63), label="budget")
    max_num_seqs = data.draw(st.integers(1, 8), label="max_num_seqs")
    specs = data.draw(
        st.lists(
            st.tuples(
                st.integers(0, 30),  # arrival step
                st.integers(1, max_model_len - 1),  # prompt length
                st.integers(1, 40),  # max_tokens
                # eos ids; the last set stops ~1 token in 9, often while a step is in flight
                st.sampled_from([(), (3,), (500, 999), tuple(range(0, 1000, 9))]),
            ),
            min_size=1,
            max_size=10,
        ),
        label="requests",
    )

    def build() -> list[tuple[int, Request]]:
        return [(t, make_req(f"r{i}", p, m, seed=i, eos=e)) for i, (t, p, m, e) in enumerate(specs)]

    overlap = data.draw(st.booleans(), label="overlap")
    tight = build()
    drive(
        Scheduler(
            BlockManager(num_blocks),
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_model_len,
            enable_chunked_prefill=chunked,
        ),
        tight,
        overlap=overlap,
    )
    free = build()
    drive(make_sched(max_model_len=max_model_len), free)
    for (_, r), (_, ref) in zip(tight, free):
        assert r.is_finished and r.output_token_ids == ref.output_token_ids
        assert r.output_token_ids == reference_output(r, max_model_len)
        assert r.status is ref.status
