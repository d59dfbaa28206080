"""CUDA-graph capture helpers shared by the graph runtime and the kernel tuner."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def gc_paused() -> Iterator[None]:
    """Keep Python's cyclic garbage collector from running inside a CUDA graph capture.

    A collection there may destroy an unreachable ``CUDAGraph`` (say, of an engine that was
    dropped while in a reference cycle); its ``reset`` is not permitted while a stream is
    capturing, and invalidates the capture in progress. ``torch.cuda.graph`` collects right
    before capture begins, so pausing the collector for the capture loses nothing.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
