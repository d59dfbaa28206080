"""A data-parallel worker: one rank's engine, driven over its end of a pipe.

Each message from the driver is ``(op, *args)``; each gets one reply, ``("ok", value)``,
``("invalid", message)`` for a request the engine refuses, or ``("fault", traceback)``
after which the worker exits. The driver's ``("step",)`` makes the engine take one step,
which includes this rank's part of the tier agreement, so every rank steps in lockstep.
"""

from __future__ import annotations

import dataclasses
import traceback
from multiprocessing.connection import Connection

import torch.distributed as dist

from replaylm.config import EngineArgs
from replaylm.distributed.agreement import TierAgreement, init_group
from replaylm.engine.core import EngineCore


def load_tokens(core: EngineCore) -> int:
    """The rank's load: tokens of its running and waiting requests."""
    sched = core.scheduler
    return sum(r.num_tokens for r in sched.running) + sum(r.num_tokens for r in sched.waiting)


def worker_main(rank: int, world_size: int, init_method: str, args: EngineArgs,
                conn: Connection) -> None:
    """The worker process's entry point (``torch.multiprocessing`` spawn target)."""
    try:
        init_group(rank, world_size, init_method, args.distributed_timeout_s)
        core = EngineCore(args)
        core.agree = TierAgreement()
        conn.send(("ok", {"device": core.device, "dtype": core.dtype,
                          "graph_mode": core.graph_mode, "num_blocks": core.runner.num_blocks}))
        while True:
            op, *rest = conn.recv()
            if op == "shutdown":
                conn.send(("ok", None))
                return
            conn.send(_handle(core, op, rest))
    except (EOFError, KeyboardInterrupt):  # the driver is gone
        return
    except BaseException:
        try:
            conn.send(("fault", traceback.format_exc()))
        except OSError:
            pass
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _handle(core: EngineCore, op: str, args: list) -> tuple[str, object]:
    if op == "step":
        deltas = core.step()
        return "ok", (deltas, core.has_unfinished(), load_tokens(core))
    if op == "add":
        try:
            core.add_request(*args)
        except ValueError as e:
            return "invalid", str(e)
        return "ok", load_tokens(core)
    if op == "abort":
        return "ok", core.abort(*args)
    if op == "stats":
        stats = dataclasses.replace(core.stats, graphs=None, spec=None)
        return "ok", (stats, core.graph_stats())
    raise ValueError(f"unknown data-parallel worker message {op!r}")
