"""A worker process: one rank's engine (a leader) or model shard (a tensor-parallel follower).

Global rank ``g`` is tensor-parallel rank ``g % N`` of data-parallel rank ``g // N`` (N =
``tensor_parallel_size``). Rank 0 of each tensor-parallel group, the leader, runs an
``EngineCore`` (scheduler, KV blocks, sampling of its requests) driven by the driver over its
pipe: each message ``(op, *args)`` gets one reply, ``("ok", value)``, ``("invalid", message)``
for a request the engine refuses, or ``("fault", traceback)`` after which the worker exits.
The driver's ``("step",)`` makes the engine take one step, which includes this rank's part of
the tier agreement, so every data-parallel rank steps in lockstep.

The leader's runner sends each step to its followers in one message over a pipe
(``("step", StepInput)``, ``("idle",)``, ``("stop",)``, and after an in-place weight update
it checked, ``("update_weights", source)``, and ``("sleep", level)``, ``("wake_up",)``,
``("resize_kv_cache", num_blocks)`` after the leader's own; its LoRA slot changes,
``("lora_load", slot, request)`` and ``("lora_clear", slot)``, before the steps that use
them); a follower runs the same step on its
shard (same dispatch, same collectives, same replicated sampling, or the leader's tokens
where only the leader can sample: ``StepInput.tokens_from_leader``) and answers nothing, so a
step costs the leader one send per follower. Followers answer the driver only at start-up or
with a fault; the driver watches every process, so a follower that dies is named at once.
"""

from __future__ import annotations

import dataclasses
import signal
import time
import traceback
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from replaylm.config import EngineArgs
from replaylm.distributed.agreement import TierAgreement, init_group, tensor_parallel_group
from replaylm.engine.core import EngineCore
from replaylm.engine.loading import load_model_config, resolve_weights_dir
from replaylm.engine.model_runner import ModelRunner
from replaylm.engine.runner_setup import resolve_device
from replaylm.engine.stats import EngineStats
from replaylm.engine.validation import resolve_max_model_len
from replaylm.model.parallel import DataParallelAttention, TensorParallel
from replaylm.model.weight_update import from_wire

#: Seconds between the statistics a leader attaches to its step replies (the driver's live
#: view, which the server's ``/metrics`` reads); a rank that runs out of work always sends.
SNAPSHOT_EVERY_S = 0.25


def load_tokens(core: EngineCore) -> int:
    """The rank's load: tokens of its running and waiting requests."""
    sched = core.scheduler
    return sum(r.num_tokens for r in sched.running) + sum(r.num_tokens for r in sched.waiting)


def worker_main(rank: int, init_method: str, args: EngineArgs, conn: Connection,
                tp_conns: list[Connection]) -> None:
    """The worker process's entry point (``torch.multiprocessing`` spawn target).
    ``tp_conns``: a leader's pipes to its followers, or a follower's one pipe from its leader."""
    # The driver owns the workers' lifetime: Ctrl-C reaches the driver (a server then drains
    # its requests through the workers), never a worker on its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        dp, tp = args.data_parallel_size, args.tensor_parallel_size
        if resolve_device(args.device).type != "cuda":  # the ranks share the host's cores
            torch.set_num_threads(max(1, torch.get_num_threads() // (dp * tp)))
        args, tpc, agree, dpa = join_groups(rank, rank, init_method, args)
        if rank % tp == 0:
            _lead(args, tpc, agree, conn, tp_conns, dpa)
        else:
            _follow(args, tpc, agree, conn, tp_conns[0])
    except (EOFError, KeyboardInterrupt):  # the driver (or the leader) is gone
        return
    except BaseException:
        try:
            conn.send(("fault", traceback.format_exc()))
        except OSError:
            pass
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def join_groups(rank: int, local_rank: int, init_method: str, args: EngineArgs
                ) -> tuple[EngineArgs, TensorParallel | None, TierAgreement | None,
                           DataParallelAttention | None]:
    """Join the ranks' process groups (every rank calls this, in the same order): ``args``
    with this rank's device (``cuda:local_rank`` on CUDA), its tensor-parallel communicator
    (None without tensor parallelism), its tier agreement (None without data parallelism)
    and its data-parallel-attention communicator (None without ``enable_dp_attention``)."""
    dp, tp = args.data_parallel_size, args.tensor_parallel_size
    cuda = resolve_device(args.device).type == "cuda"
    if cuda:  # one GPU per rank
        torch.cuda.set_device(local_rank)
        args = args.replace(device=f"cuda:{local_rank}")
    init_group(rank, dp * tp, init_method, args.distributed_timeout_s, cuda)
    tpc = None
    if tp > 1:
        group = tensor_parallel_group(rank, dp, tp, args.distributed_timeout_s)
        cfg, _ = load_model_config(args.model)
        tpc = TensorParallel(rank % tp, tp, group, cfg.num_kv_heads)
        # Create the group's communicators now, not inside a graph capture.
        tpc.all_reduce(torch.zeros(1, device=resolve_device(args.device)))
    dpa = _dp_attention(rank, args) if args.enable_dp_attention else None
    return args, tpc, TierAgreement() if dp > 1 else None, dpa


def _dp_attention(rank: int, args: EngineArgs) -> DataParallelAttention:
    """Data-parallel attention: every rank (tensor_parallel_size is 1) holds a slice of the
    MLP, whose collectives run over the whole group."""
    dpa = DataParallelAttention(rank, args.data_parallel_size)
    # Create the communicators now, not inside a graph capture.
    x = torch.zeros(dpa.size, device=resolve_device(args.device))
    dpa.scatter_sum(dpa.gather_rows(x))
    return dpa


def leader_core(args: EngineArgs, tpc: TensorParallel | None, agree: TierAgreement | None,
                followers: list, dpa: DataParallelAttention | None = None) -> EngineCore:
    """A data-parallel rank's engine; its runner sends each step to ``followers`` (one
    message per follower: anything with ``send``, a pipe or a ``RankChannel``)."""
    core = EngineCore(args, tpc, dpa)
    core.agree = agree
    if followers:
        def broadcast(msg: tuple) -> None:
            for c in followers:
                c.send(msg)

        core.runner.broadcast = broadcast
    return core


def start_info(core: EngineCore) -> dict:
    """What a leader tells the driver once its engine is up."""
    return {"device": core.device, "dtype": core.dtype, "graph_mode": core.graph_mode,
            "num_blocks": core.runner.num_blocks, "tune_seconds": core.runner.tune_seconds,
            "stats": _snapshot(core)}


def _lead(args: EngineArgs, tpc: TensorParallel | None, agree: TierAgreement | None,
          conn: Connection, followers: list[Connection],
          dpa: DataParallelAttention | None = None) -> None:
    core = leader_core(args, tpc, agree, followers, dpa)
    conn.send(("ok", start_info(core)))
    while True:
        op, *rest = conn.recv()
        if op == "shutdown":
            for c in followers:
                c.send(("stop",))
            conn.send(("ok", None))
            return
        conn.send(_handle(core, op, rest))


def _follow(args: EngineArgs, tpc: TensorParallel, agree: TierAgreement | None,
            conn: Connection, leader: Connection) -> None:
    """Run every step the leader sends. The follower never waits for its own samples: its
    staging buffers (two rows, alternating) are safe because every step's collectives tie
    its device to the leader's, and the leader sends step N + 2 only after step N's samples
    reached its host, so this rank's copies for step N have run by then."""
    cfg, model_dir = load_model_config(args.model)
    runner = ModelRunner(args, cfg, resolve_weights_dir(model_dir, cfg, args.load_format),
                         resolve_max_model_len(args, cfg), tpc)
    runner.prepare_sleep()
    conn.send(("ok", {"device": runner.device, "dtype": runner.dtype,
                      "graph_mode": runner.graph_mode, "num_blocks": runner.num_blocks,
                      "tune_seconds": runner.tune_seconds}))
    while True:
        op, *rest = leader.recv()
        if op == "step":
            runner.run_step(rest[0], agree)
            runner.sampler.take_failed()  # the leader finishes those requests
        elif op == "idle":
            runner.idle(agree)
        elif op == "update_weights":  # the leader checked it: the same checks pass here
            runner.update_weights(from_wire(rest[0]))
        elif op == "sleep":  # the leader's shard slept: this one follows
            runner.sleep(rest[0])
        elif op == "wake_up":
            runner.wake_up()
        elif op == "resize_kv_cache":  # the leader checked its requests' blocks
            runner.resize_kv(rest[0])
        elif op == "lora_load":  # the leader's LoRA slot changes, ahead of their steps
            runner.load_lora(*rest)
        elif op == "lora_clear":
            runner.lora_slots.clear(rest[0])
        else:
            return


def _snapshot(core: EngineCore) -> tuple[EngineStats, dict]:
    """The engine's counters (without the live graph object; speculative decoding's as a
    copy) and graph stats."""
    core.snapshot_at = time.monotonic()
    spec = dataclasses.replace(core.spec_stats) if core.spec_stats is not None else None
    return dataclasses.replace(core.stats, graphs=None, spec=spec), core.graph_stats()


def _handle(core: EngineCore, op: str, args: list) -> tuple[str, object]:
    if op == "step":
        deltas = core.step()
        busy = core.has_unfinished()
        due = not busy or time.monotonic() - core.snapshot_at >= SNAPSHOT_EVERY_S
        return "ok", (deltas, busy, load_tokens(core), _snapshot(core) if due else None)
    if op == "add":
        try:
            core.add_request(*args)
        except ValueError as e:
            return "invalid", str(e)
        return "ok", load_tokens(core)
    if op == "abort":
        return "ok", core.abort(*args)
    if op == "add_lora":
        try:
            core.add_lora(*args)
        except ValueError as e:
            return "invalid", str(e)
        return "ok", None
    if op == "remove_lora":
        return "ok", core.remove_lora(*args)
    if op == "stats":
        return "ok", _snapshot(core)
    if op in ("update_weights", "sleep", "wake_up", "audit_graphs", "reset_prefix_cache",
              "resize_kv_cache"):
        call = (from_wire(args[0]), args[1]) if op == "update_weights" else args
        try:
            result = getattr(core, op)(*call)
        except ValueError as e:
            return "invalid", str(e)
        except RuntimeError as e:  # asleep or awake already, or a graph audit's finding
            return "refused", (type(e).__name__, str(e))
        # The followers' shards follow what the leader's did (a draft model is the leader's).
        follow = op in ("sleep", "wake_up", "resize_kv_cache") or (op == "update_weights" and args[1] == "model")
        if follow and core.runner.broadcast is not None:
            core.runner.broadcast((op, *args[:1]))
        return "ok", result
    raise ValueError(f"unknown worker message {op!r}")
