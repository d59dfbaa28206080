"""The environment the package reads: the one place that looks at ``os.environ``.

Every engine setting is a field of ``EngineArgs``; the environment only says where the
on-disk cache lives (``REPLAYLM_CACHE``), whether Triton runs interpreted (Triton's own
``TRITON_INTERPRET``, which the kernels must follow) and, when torchrun started the process,
which rank it is (the launcher's ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ...).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


def cache_dir() -> Path:
    """Where the built-in default model's weights and the kernel tuning table are kept:
    ``$REPLAYLM_CACHE``, else ``~/.cache/replaylm``."""
    return Path(os.environ.get("REPLAYLM_CACHE", Path.home() / ".cache" / "replaylm"))


def triton_interpreted() -> bool:
    """Whether Triton kernels run on the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class LaunchedRank:
    """This process's place in a job a launcher started (torchrun sets these variables for
    every process it starts; ``init_process_group("env://")`` reads the same ones)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def launched_rank() -> LaunchedRank | None:
    """The rank torchrun (or a launcher that sets the same variables) gave this process:
    ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` all set;
    else None (a process the user started alone)."""
    env = os.environ
    if not all(k in env for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                  "MASTER_PORT")):
        return None
    world = int(env["WORLD_SIZE"])
    return LaunchedRank(int(env["RANK"]), world, int(env["LOCAL_RANK"]),
                        int(env.get("LOCAL_WORLD_SIZE", world)))
