"""CUDA-graph capture helpers shared by the graph runtime, the kernel tuner and the
all-reduce chooser."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch


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


def graph_replay_us(call: Callable[[int], object], calls: int, trials: int,
                    settle: bool = False) -> float:
    """Device µs of one ``call(i)``: ``call(0)`` once eagerly (lazy set-up stays out of the
    capture), then ``call(0) .. call(calls - 1)`` captured in one CUDA graph, best of
    ``trials`` timed replays, so host launch overhead is excluded (as inside a decode
    graph). ``settle``: each timed replay follows an untimed one, enqueued back to back (for
    collectives: the timed replay starts when the ranks leave the untimed one together)."""
    call(0)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with gc_paused(), torch.cuda.graph(g):
        for i in range(calls):
            call(i)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(trials):
        if settle:
            g.replay()
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / calls)
    # Free the graph now: left to the garbage collector, its destructor could run while a
    # later graph is being captured, which invalidates that capture.
    g.reset()
    return best
