"""``make_engine``: the ``Engine`` a configuration asks for."""

from __future__ import annotations

from replaylm.config import EngineArgs
from replaylm.distributed.driver import MultiProcessEngine
from replaylm.engine.core import EngineCore
from replaylm.engine.protocol import Engine
from replaylm.env import launched_rank


def make_engine(args: EngineArgs) -> Engine:
    """One ``EngineCore`` in this process, or the driver of worker processes for data or
    tensor parallelism (``LLM``, ``replaylm serve`` and the benchmarks all use it).

    In a process torchrun started (``env.launched_rank``), rank 0 gets the driver of the
    job's ranks and every other rank serves as a worker and exits when rank 0 shuts down
    (``distributed.torchrun``): only rank 0 returns."""
    launch = launched_rank()
    if launch is not None:
        from replaylm.distributed.torchrun import start_rank

        return start_rank(args, launch)
    if args.data_parallel_size > 1 or args.tensor_parallel_size > 1:
        return MultiProcessEngine(args)
    return EngineCore(args)
