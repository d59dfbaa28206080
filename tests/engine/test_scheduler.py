"""CPU-only tests of the scheduler: overlap, decode batching, chunked prefill, token budgets,
slots, abort and stop conditions, driven by the fake model of ``scheduler_helpers`` (preemption
and random traffic: test_scheduler_preemption.py)."""

from __future__ import annotations

import pytest

from replaylm.engine.request import RequestStatus
from tests.engine.scheduler_helpers import FakeRunner, drive, make_req, make_sched, reference_output


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


def test_mixed_prefill_cap_spreads_prompts_over_decode_steps() -> None:
    """Beside decodes a step carries at most ``max_mixed_prefill_tokens`` prompt tokens; with
    nothing to decode a step fills the budget; a decode is never held back by the cap."""
    sched = make_sched(max_num_batched_tokens=64, max_mixed_prefill_tokens=8)
    first = [make_req(f"a{i}", 20, max_tokens=6, seed=i) for i in range(3)]
    later = [make_req(f"b{i}", 10, max_tokens=2, seed=10 + i) for i in range(2)]
    outs = drive(sched, [(0, r) for r in first] + [(1, r) for r in later])
    assert outs[0].num_prefill_tokens == 60 and outs[0].num_batched_tokens == 60  # no decodes
    for out in outs[1:]:
        decodes = out.num_batched_tokens - out.num_prefill_tokens
        if decodes:
            assert out.num_prefill_tokens <= 8
    steps = [[(s.request.request_id, s.num_new_tokens) for s in o.scheduled] for o in outs]
    assert steps[1] == [("a0", 1), ("a1", 1), ("a2", 1), ("b0", 8)]
    assert steps[2] == [("a0", 1), ("a1", 1), ("a2", 1), ("b0", 2), ("b1", 6)]
    for r in first + later:
        assert r.output_token_ids == reference_output(r, 512)


def test_without_a_mixed_prefill_cap_prompts_fill_the_budget() -> None:
    sched = make_sched(max_num_batched_tokens=64)
    a, b = make_req("a", 20, max_tokens=4), make_req("b", 50, max_tokens=2, seed=1)
    outs = drive(sched, [(0, a), (1, b)])
    assert [(s.request.request_id, s.num_new_tokens) for s in outs[1].scheduled] == [
        ("a", 1), ("b", 50)]
    assert outs[1].num_prefill_tokens == 50


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
