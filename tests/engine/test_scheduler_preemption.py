"""CPU-only tests of the scheduler under tight KV pools: preemption (who goes, where it
requeues, no admission in the same step), and random traffic (hypothesis) that must give the
outputs of an unconstrained scheduler and of the plain reference."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replaylm.batch import BLOCK_SIZE
from replaylm.engine.block_manager import BlockManager
from replaylm.engine.request import Request, RequestStatus
from replaylm.engine.scheduler import Scheduler
from tests.engine.scheduler_helpers import (
    FakeRunner,
    drive,
    make_req,
    make_sched,
    reference_output,
    step_sync,
)


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


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
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
    mixed_cap = data.draw(st.integers(0, 24), label="max_mixed_prefill_tokens")
    tight = build()
    drive(
        Scheduler(
            BlockManager(num_blocks),
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_model_len,
            enable_chunked_prefill=chunked,
            max_mixed_prefill_tokens=mixed_cap,
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
