"""Seconds this process spends in Triton's compiler, so a start-up can tell JIT compiling
apart from the work around it (``replaylm bench startup``).

``install`` registers a listener with Triton (``triton.knobs.compilation.listener``, which
its compiler calls after every compile with the stage times), chained after any listener
already there. Each call adds to ``TOTALS``: a kernel built from source (``compiled``), or
one found in Triton's on-disk cache (``loaded``). Compiles on several threads
(``tuner.precompile``) add up their own seconds, so the sum can exceed the wall time.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any


@dataclasses.dataclass
class JitTotals:
    """Kernels compiled from source and their seconds; kernels loaded from Triton's disk
    cache and their seconds."""

    compiled: int = 0
    compile_s: float = 0.0
    loaded: int = 0
    load_s: float = 0.0

    def since(self, before: JitTotals) -> JitTotals:
        return JitTotals(self.compiled - before.compiled, self.compile_s - before.compile_s,
                         self.loaded - before.loaded, self.load_s - before.load_s)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


TOTALS = JitTotals()
_lock = threading.Lock()
_installed = False


def record(seconds: float, cache_hit: bool) -> None:
    """Add one compile (or disk-cache load) of ``seconds`` to ``TOTALS``."""
    with _lock:
        if cache_hit:
            TOTALS.loaded += 1
            TOTALS.load_s += seconds
        else:
            TOTALS.compiled += 1
            TOTALS.compile_s += seconds


def install() -> None:
    """Count Triton's compiles from now on (once per process; a no-op without Triton)."""
    global _installed
    if _installed:
        return
    try:
        import triton
    except ImportError:
        return
    compilation = triton.knobs.compilation
    previous = compilation.listener

    def listener(*, src, metadata, metadata_group, times, cache_hit) -> None:
        record(times.total / 1e6, cache_hit)
        if previous is not None:
            previous(src=src, metadata=metadata, metadata_group=metadata_group, times=times,
                     cache_hit=cache_hit)

    compilation.listener = listener
    _installed = True


def snapshot() -> JitTotals:
    """A copy of ``TOTALS`` (subtract two with ``since``)."""
    with _lock:
        return dataclasses.replace(TOTALS)
