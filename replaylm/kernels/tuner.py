"""Measured kernel choices for the projections at a few rows.

Neither cuBLAS nor the skinny kernel (``kernels.skinny``) wins everywhere: at one row
Qwen3-0.6B's o_proj (1024x2048) takes 12.6 µs in cuBLAS and 2.3 µs in the skinny kernel,
while at four rows its qkv (4096x1024) is faster in cuBLAS (H200, in CUDA graphs). So for
each shape :func:`choose` times the unfused path (cuBLAS, or the separate prologue op plus
the projection) against every tile candidate of the skinny kernel, each replayed from a CUDA
graph, and keeps the fastest: in memory (``LINEAR_CHOICES``) and on disk
(``kernels.tuning_cache``).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
from collections.abc import Callable, Sequence

import torch

from replaylm.capture import gc_paused
from replaylm.kernels import elementwise, skinny
from replaylm.kernels.tuning_cache import Decision, TuningCache

log = logging.getLogger(__name__)

#: Relative timing difference under which the tuner treats two tiles as equal (``_tune``).
TIE = 0.02

#: (prologue, m, n, k, dtype, has_bias) -> decision (``tuning_cache.Decision``). Prologue
#: "plain" is a bare projection (unfused = cuBLAS); "norm"/"norm0" (with/without a residual)
#: and "silu" fold the residual add + RMSNorm or SiLU·mul into the projection's input
#: (unfused = that op's own kernel, then the projection).
LINEAR_CHOICES: dict[tuple, Decision] = {}


def weight_rotation(weight: torch.Tensor) -> list[torch.Tensor]:
    """``weight`` and enough copies of it (at most 16) to exceed twice the L2 cache together:
    timing calls that cycle through them stream their weights from HBM, as a decode step does
    (each layer's weights are read once per step), rather than from L2, as repeats of one
    matrix would. Matrices under an eighth of L2 stay partly L2-resident."""
    l2 = torch.cuda.get_device_properties(weight.device).L2_cache_size
    copies = min(16, -(-2 * l2 // max(1, weight.numel() * weight.element_size())))
    return [weight] + [weight.clone() for _ in range(copies - 1)]


def graph_time_us(fn: Callable[[torch.Tensor], object], weights: Sequence[torch.Tensor],
                  reps: int = 20, trials: int = 3) -> float:
    """Device time of one ``fn(w)`` call: ``reps`` calls captured in one CUDA graph, best of
    ``trials`` replays, so host launch overhead is excluded (as inside a decode graph). The
    calls cycle through ``weights`` (``weight_rotation``: from HBM, not L2)."""
    fn(weights[0])
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with gc_paused(), torch.cuda.graph(g):
        for i in range(reps):
            fn(weights[i % len(weights)])
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(trials):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / reps)
    # Free the graph now: left to the garbage collector, its destructor could run while a
    # later graph is being captured, which invalidates that capture.
    g.reset()
    return best


@functools.cache
def kernels_revision() -> str:
    """A digest of what the decisions depend on: the Triton sources of the skinny kernel and
    of the separate norm and SiLU·mul kernels the fused prologues are timed against, the
    tile candidates and the decision rule (``_tune``). An edited kernel or rule invalidates
    the decisions cached on disk; an edit of other host code or docs does not."""
    digest = hashlib.sha1(repr((skinny.CANDIDATES, skinny.MAX_UNROLL, skinny.MAX_M,
                                TIE)).encode())
    for kernel in (skinny._weight_chunk, skinny._input_chunk, skinny._accumulate,
                   skinny._skinny_kernel, elementwise._add_rmsnorm_kernel,
                   elementwise._silu_mul_kernel):
        digest.update(inspect.getsource(kernel.fn).encode())
    digest.update(inspect.getsource(_tune).encode())
    return digest.hexdigest()[:12]


@functools.cache
def _cache() -> TuningCache:
    return TuningCache(kernels_revision())


def choose(key: tuple, weight: torch.Tensor, unfused: Callable[[torch.Tensor], object],
           fused: Callable[[tuple[int, int, int, int], torch.Tensor], object]):
    """The skinny-kernel config to use for ``key`` = ``(prologue, m, n, k, dtype, bias)``, or
    None when ``unfused`` (cuBLAS, or the separate prologue op plus the projection) is faster.

    Decided on first use outside graph capture by timing ``unfused(w)`` and ``fused(config, w)``
    for every candidate config (``w`` cycles through copies of ``weight``, the projection's
    weight); then kept in memory and on disk. An undecided shape during capture takes
    ``unfused``.
    """
    choice = LINEAR_CHOICES.get(key)
    if choice is None:
        if torch.cuda.is_current_stream_capturing():
            return None
        choice = _cache().lookup(key, weight.device)
        if choice is None:
            choice = _tune(key, weight_rotation(weight), unfused, fused)
            _cache().store(key, weight.device, choice)
        LINEAR_CHOICES[key] = choice
    return choice[0]


def _tune(key: tuple, weights: Sequence[torch.Tensor], unfused: Callable[[torch.Tensor], object],
          fused: Callable[[tuple[int, int, int, int], torch.Tensor], object]) -> Decision:
    """(chosen config or None for the unfused path, its µs, the unfused path's µs).

    Timings within ``TIE`` of each other count as equal, and the lighter choice wins, for
    what timing one shape alone cannot see:

    - among tiles, the one with the fewest warps: in a decode step a projection's programs
      launch early (PDL) into whatever SM room the kernel before leaves, where lighter
      programs fit better (Qwen3-0.6B's o_proj on the H200: 2.17 µs alone with 4 warps
      against 2.21 µs with 8, yet batch-1 decode is about 1% faster with the 4-warp tile);
    - against the unfused path (cuBLAS, or the prologue's own kernel and then the
      projection), the skinny kernel: one launch, so one graph node fewer per layer. On
      Qwen3-0.6B's down_proj the two measure 3.6-3.9 µs each, and taking the unfused path
      on such a near-tie cost batch-1 decode 1.6% (H200).
    """
    kind, m, n, k = key[:4]
    baseline = graph_time_us(unfused, weights)
    timed = [(cfg, graph_time_us(lambda w, cfg=cfg: fused(cfg, w), weights))
             for cfg in skinny.candidate_configs(m, k)]
    fastest = min(us for _, us in timed)
    best, best_us = min(((cfg, us) for cfg, us in timed if us <= fastest * (1 + TIE)),
                        key=lambda c: (c[0][3], c[1]))
    if best_us > baseline * (1 + TIE):
        best, best_us = None, baseline
    log.info("%s linear %dx%dx%d: unfused %.2f us, best %s %.2f us", kind, m, n, k, baseline,
             "unfused" if best is None else f"triton {best}", best_us)
    return best, round(best_us, 2), round(baseline, 2)
