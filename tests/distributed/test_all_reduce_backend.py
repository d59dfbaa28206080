"""``EngineArgs.all_reduce_backend``: validation, the plan chosen from measured latencies, the
size dispatch, and the fall-back where symmetric memory cannot run (CPU). The two-process
engine check is in test_tensor_parallel.py; the GPU ones in tests/gpu/test_all_reduce_gpu.py."""

from __future__ import annotations

import argparse

import pytest
import torch

from replaylm.config import EngineArgs
from replaylm.model.allreduce import (
    NCCL,
    ONE_SHOT,
    TWO_SHOT,
    AllReducer,
    pick_plan,
    plan_summary,
    symm_mem_unavailable,
)
from replaylm.model.parallel import TensorParallel

ROW = 64 * 2  # bytes of one bf16 row of hidden size 64


def test_the_setting_is_validated_naming_the_field() -> None:
    assert EngineArgs().all_reduce_backend == "auto"
    EngineArgs(all_reduce_backend="nccl")
    EngineArgs(all_reduce_backend="symm_mem", tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"all_reduce_backend='mpi' is invalid.*'symm_mem'"):
        EngineArgs(all_reduce_backend="mpi")
    with pytest.raises(ValueError, match=r"all_reduce_backend='symm_mem' needs "
                                         r"tensor_parallel_size > 1"):
        EngineArgs(all_reduce_backend="symm_mem")
    with pytest.raises(ValueError, match=r"all_reduce_backend='symm_mem' needs CUDA"):
        EngineArgs(all_reduce_backend="symm_mem", tensor_parallel_size=2, device="cpu")
    with pytest.raises(ValueError, match=r"all_reduce_backend='symm_mem' needs dtype bfloat16"):
        EngineArgs(all_reduce_backend="symm_mem", tensor_parallel_size=2, dtype="float16")


def test_the_cli_flag_comes_from_the_field() -> None:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    ns = parser.parse_args(["--all-reduce-backend", "nccl"])
    assert EngineArgs.from_cli_args(ns).all_reduce_backend == "nccl"
    with pytest.raises(SystemExit):
        parser.parse_args(["--all-reduce-backend", "custom"])


def test_the_plan_takes_the_fastest_allowed_algorithm_per_bucket() -> None:
    latency = {  # bytes -> algorithm -> microseconds, as the ranks' largest
        1 * ROW: {NCCL: 9.0, ONE_SHOT: 4.0, TWO_SHOT: 6.0},
        8 * ROW: {NCCL: 9.5, ONE_SHOT: 5.0, TWO_SHOT: 5.0},  # tie: the earlier allowed wins
        64 * ROW: {NCCL: 11.0, ONE_SHOT: 12.0, TWO_SHOT: 8.0},
        256 * ROW: {NCCL: 14.0, ONE_SHOT: 30.0, TWO_SHOT: 15.0},
    }
    auto = pick_plan(latency, [NCCL, ONE_SHOT, TWO_SHOT])
    assert auto == ((ROW, ONE_SHOT), (8 * ROW, ONE_SHOT), (64 * ROW, TWO_SHOT),
                    (256 * ROW, NCCL))
    assert plan_summary(auto, ROW) == "one_shot up to 8 tokens, two_shot up to 64 tokens, " \
                                      "nccl above"
    # symm_mem: NCCL is not a candidate below the largest bucket, whatever it measured.
    symm = pick_plan(latency, [ONE_SHOT, TWO_SHOT])
    assert [a for _, a in symm] == [ONE_SHOT, ONE_SHOT, TWO_SHOT, TWO_SHOT]
    assert plan_summary(symm, ROW) == "one_shot up to 8 tokens, two_shot up to 256 tokens, " \
                                      "nccl above"
    # NCCL fastest everywhere: nothing on symmetric memory.
    slow = {n: {NCCL: 1.0, ONE_SHOT: 2.0} for n in latency}
    assert all(a == NCCL for _, a in pick_plan(slow, [NCCL, ONE_SHOT, TWO_SHOT]))
    assert plan_summary(pick_plan(slow, [NCCL, ONE_SHOT]), ROW) == "nccl for every size"
    # NCCL only in the middle: named as a run of its own.
    mixed = {ROW: {NCCL: 5.0, ONE_SHOT: 1.0}, 8 * ROW: {NCCL: 1.0, ONE_SHOT: 5.0},
             64 * ROW: {NCCL: 5.0, ONE_SHOT: 1.0}}
    assert plan_summary(pick_plan(mixed, [NCCL, ONE_SHOT]), ROW) == \
        "one_shot up to 1 tokens, nccl up to 8 tokens, one_shot up to 64 tokens, nccl above"
    # An allowed algorithm that was not measured (two-shot at 3 ranks) is never chosen.
    assert pick_plan({ROW: {NCCL: 3.0, ONE_SHOT: 4.0}}, [ONE_SHOT, TWO_SHOT]) == \
        ((ROW, ONE_SHOT),)


def test_each_message_runs_the_plan_of_the_smallest_bucket_that_holds_it() -> None:
    reducer = AllReducer()
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    assert reducer.algorithm(x) == NCCL  # not configured: torch.distributed
    reducer.plan = ((ROW, ONE_SHOT), (8 * ROW, TWO_SHOT), (64 * ROW, NCCL))
    reducer.buffer = torch.zeros(64 * 64, dtype=torch.bfloat16)  # stands in for the buffer
    assert reducer.algorithm(torch.zeros(1, 64, dtype=torch.bfloat16)) == ONE_SHOT
    assert reducer.algorithm(x) == TWO_SHOT  # 4 rows: the 8-row bucket's choice
    assert reducer.algorithm(torch.zeros(8, 64, dtype=torch.bfloat16)) == TWO_SHOT
    assert reducer.algorithm(torch.zeros(9, 64, dtype=torch.bfloat16)) == NCCL
    assert reducer.algorithm(torch.zeros(65, 64, dtype=torch.bfloat16)) == NCCL  # above all
    # What the symmetric kernels cannot take goes to NCCL whatever the plan says.
    assert reducer.algorithm(torch.zeros(1, 64, dtype=torch.float32)) == NCCL  # other dtype
    assert reducer.algorithm(torch.zeros(64, 2, dtype=torch.bfloat16).t()) == NCCL  # strided
    assert reducer.algorithm(torch.zeros(65, dtype=torch.bfloat16)[1:]) == NCCL  # unaligned
    assert reducer.algorithm(torch.zeros(3, dtype=torch.bfloat16)) == NCCL  # 6 bytes


def test_where_symmetric_memory_cannot_run_auto_keeps_the_plain_all_reduce() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert "needs CUDA tensors (device cpu)" in symm_mem_unavailable(cpu, torch.float32)
    assert "bfloat16 and float32, not float16" in symm_mem_unavailable(cuda, torch.float16)
    reducer = AllReducer()
    report = reducer.configure("auto", None, 64, torch.float32, cpu)
    assert report["summary"] == "gloo for every size"
    assert report["reason"] == ("symmetric memory needs CUDA tensors (device cpu): the "
                                "all-reduce runs on gloo")
    assert reducer.plan == () and reducer.buffer is None
    assert reducer.configure("nccl", None, 64, torch.float32, cpu) is report  # decided once
    nccl = AllReducer().configure("nccl", None, 64, torch.bfloat16, cuda)  # no measurement
    assert (nccl["summary"], nccl["latency_us"]) == ("nccl for every size", {})
    with pytest.raises(ValueError, match=r"all_reduce_backend='symm_mem' cannot work here: "
                                         r"symmetric memory needs CUDA"):
        AllReducer().configure("symm_mem", None, 64, torch.float32, cpu)
    with pytest.raises(ValueError, match=r"all_reduce_backend='symm_mem' cannot work here: "
                                         r".*not float16"):
        AllReducer().configure("symm_mem", None, 64, torch.float16, cuda)


def test_each_tensor_parallel_rank_has_its_own_reducer() -> None:
    a, b = TensorParallel(0, 2), TensorParallel(1, 2)
    assert a.reducer is not b.reducer
    assert a == TensorParallel(0, 2)  # the reducer is no part of the rank's identity
