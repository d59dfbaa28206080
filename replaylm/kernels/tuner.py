"""Measured kernel choices for the projections at a few rows.

Neither cuBLAS nor the skinny kernel (``kernels.skinny``) wins everywhere: at one row
Qwen3-0.6B's o_proj (1024x2048) takes 12.6 µs in cuBLAS and 2.3 µs in the skinny kernel,
while at four rows its qkv (4096x1024) is faster in cuBLAS (H200, in CUDA graphs). So for
each shape :func:`choose` times the unfused path (cuBLAS, or the separate prologue op plus
the projection) against every tile candidate of the skinny kernel, each replayed from a CUDA
graph, and keeps the fastest: in memory (``LINEAR_CHOICES``) and on disk
(``kernels.tuning_cache``).

A shape's decision comes from, in order: this process's memory, the user's cache (what this
machine measured), the table shipped for this GPU model (what the engine measured on a lab
machine with the same GPU, versions and kernel sources; ``configure``), and only then from
timing it here. Local measurements win over the shipped table: they were taken on this very
GPU, and a user who wants the table's choice back removes the cache file.

Compiling the candidates takes most of a tuning run (each tile is its own Triton kernel), so
the engine first runs its dense calls under :func:`precompile`, which compiles every
candidate the timing pass will need on a thread pool, and then times them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import inspect
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
import triton

from replaylm.capture import graph_replay_us
from replaylm.kernels import elementwise, fp8_linear, ref, skinny, skinny_epilogue, skinny_split
from replaylm.kernels.tuning_cache import Decision, TuningCache, shipped_path

log = logging.getLogger(__name__)

#: Relative timing difference under which the tuner treats two tiles as equal (``_tune``).
TIE = 0.02

#: (prologue, m, n, k, dtype, has_bias) -> decision (``tuning_cache.Decision``). Prologue
#: "plain" is a bare projection (unfused = cuBLAS); "norm"/"norm0" (with/without a residual)
#: and "silu" fold the residual add + RMSNorm or SiLU·mul into the projection's input
#: (unfused = that op's own kernel, then the projection). With FP8 weights the prologue
#: carries ``-fp8`` ("plain-fp8", ...) and the unfused projection is
#: ``fp8_linear.matmul``.
LINEAR_CHOICES: dict[tuple, Decision] = {}

#: Where a decision can come from (``TuningStats.sources``): the user's cache, the shipped
#: table, or timing it now.
SOURCES = ("cache", "shipped", "tuned")


@dataclasses.dataclass
class TuningStats:
    """What this process's tuner did: decisions by source (counted when a shape is first
    decided in the process), shapes timed and their candidates, seconds spent timing (with
    the compiles of candidates not compiled ahead), and the :func:`precompile` passes
    (wall seconds and kernels submitted)."""

    sources: Counter = dataclasses.field(default_factory=Counter)
    candidates_timed: int = 0
    timing_s: float = 0.0
    precompile_s: float = 0.0
    precompiled: int = 0

    def copy(self) -> TuningStats:
        return dataclasses.replace(self, sources=Counter(self.sources))

    def since(self, before: TuningStats) -> TuningStats:
        """What happened after the snapshot ``before``."""
        return TuningStats(
            sources=self.sources - before.sources,
            candidates_timed=self.candidates_timed - before.candidates_timed,
            timing_s=self.timing_s - before.timing_s,
            precompile_s=self.precompile_s - before.precompile_s,
            precompiled=self.precompiled - before.precompiled)

    def as_dict(self) -> dict:
        return {"sources": {s: self.sources.get(s, 0) for s in SOURCES},
                "candidates_timed": self.candidates_timed, "timing_s": self.timing_s,
                "precompile_s": self.precompile_s, "precompiled": self.precompiled}


STATS = TuningStats()

#: Whether the shipped table is consulted (``configure``).
_use_shipped = True
#: What ``choose`` does while :func:`decide_all` runs its passes: None (decide), "unfused"
#: (return None: the callers' unfused paths run) or "precompile" (compile ahead, then None).
_pass: str | None = None


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
    return graph_replay_us(lambda i: fn(weights[i % len(weights)]), reps, trials)


@functools.cache
def kernels_revision() -> str:
    """A digest of what the decisions depend on: the Triton sources of the skinny kernel (and
    its split-K reduction) and of the separate norm and SiLU·mul kernels the fused prologues
    are timed against, the FP8 weights' unfused path (``fp8_linear``), the tile candidates
    and the decision rule (``pick_tile``, ``_tune``). An edited kernel or rule invalidates
    the decisions cached on disk; an edit of other host code or docs does not."""
    digest = hashlib.sha1(repr((skinny.CANDIDATES, skinny.CANDIDATES_FP8, skinny.MAX_UNROLL,
                                skinny.MAX_M, skinny_split.SPLIT_CANDIDATES,
                                skinny_split.SPLIT_CANDIDATES_FP8,
                                skinny_split.REDUCE_BLOCK_N, TIE)).encode())
    for kernel in (skinny._weight_chunk, skinny._input_chunk, skinny._accumulate,
                   skinny._load_strip, skinny._strip_sums, skinny_epilogue._epilogue,
                   skinny_epilogue._store_silu_pairs,
                   skinny._skinny_kernel, skinny_split._reduce_kernel,
                   elementwise._add_rmsnorm_kernel, elementwise._silu_mul_kernel):
        digest.update(inspect.getsource(kernel.fn).encode())
    digest.update(inspect.getsource(fp8_linear).encode())  # FP8 weights' unfused path
    digest.update(inspect.getsource(pick_tile).encode())
    digest.update(inspect.getsource(_tune).encode())
    return digest.hexdigest()[:12]


@functools.cache
def _cache() -> TuningCache:
    return TuningCache(kernels_revision())


@functools.cache
def _shipped(gpu: str) -> TuningCache:
    return TuningCache(kernels_revision(), shipped_path(gpu), read_only=True)


@functools.cache
def _gpu_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device)


def configure(shipped_table: bool) -> None:
    """Whether decisions the user's cache lacks are taken from the table shipped for this
    GPU (``EngineArgs.shipped_tuning_table``; process-wide, like the decisions)."""
    global _use_shipped
    _use_shipped = shipped_table


def _stored(key: tuple, gpu: str) -> tuple[Decision, str] | None:
    """The decision on disk for ``key`` and where it was found (``SOURCES``), or None."""
    hit = _cache().lookup(key, gpu)
    if hit is not None:
        return hit, "cache"
    if _use_shipped:
        hit = _shipped(gpu).lookup(key, gpu)
        if hit is not None:
            return hit, "shipped"
    return None


def _weight_dtype(key: tuple) -> torch.dtype | None:
    """The weights' dtype a key's candidates are for: FP8 for a ``-fp8`` prologue."""
    return ref.FP8_DTYPE if key[0].endswith("-fp8") else None


def candidates(m: int, k: int, weight_dtype: torch.dtype | None = None,
               ) -> list[tuple[int, ...]]:
    """The tiles timed for ``m`` rows, reduction length ``k`` and weights of
    ``weight_dtype``: ``skinny.candidate_configs`` without repeats. Capping ``BLOCK_K`` at ``k`` turns some candidates into copies of
    others (at ``k`` = 1024 the 2x2048 tile becomes the 2x1024 one); a copy is the same
    kernel, so timing it again cannot change the decision."""
    return list(dict.fromkeys(skinny.candidate_configs(m, k, weight_dtype)))


def choose(key: tuple, weight: torch.Tensor, unfused: Callable[[torch.Tensor], object],
           fused: Callable[[tuple[int, ...], torch.Tensor], object]):
    """The skinny-kernel config to use for ``key`` = ``(prologue, m, n, k, dtype, bias)`` (the
    prologue marked ``-fp8`` for FP8 weights: ``kernels.ops``), or
    None when ``unfused`` (cuBLAS, or the separate prologue op plus the projection) is faster.

    Decided on first use outside graph capture: from the user's cache or the shipped table
    (``_stored``), else by timing ``unfused(w)`` and ``fused(config, w)`` for every
    candidate config (``w`` cycles through copies of ``weight``, the projection's weight);
    then kept in memory and, when timed, in the user's cache. An undecided shape during
    capture takes ``unfused``. Under :func:`precompile` it only compiles what the shape will
    need (the chosen config, or every candidate when undecided) and returns None; in
    :func:`decide_all`'s first pass it returns None at once.
    """
    if _pass == "unfused":
        return None
    choice = LINEAR_CHOICES.get(key)
    if choice is None:
        if torch.cuda.is_current_stream_capturing():
            return None
        gpu = _gpu_name(weight.device)
        found = _stored(key, gpu)
        if found is None:
            if _pass == "precompile":
                _compile_ahead(fused, candidates(key[1], key[3], _weight_dtype(key)), weight)
                return None
            start = time.perf_counter()
            choice, source = _tune(key, weight_rotation(weight), unfused, fused), "tuned"
            STATS.timing_s += time.perf_counter() - start
            STATS.candidates_timed += len(candidates(key[1], key[3], _weight_dtype(key)))
            _cache().store(key, gpu, choice)
        else:
            choice, source = found
        LINEAR_CHOICES[key] = choice
        STATS.sources[source] += 1
    if _pass == "precompile":
        if choice[0] is not None:
            _compile_ahead(fused, [choice[0]], weight)
        return None
    return choice[0]


def _compile_ahead(fused: Callable[[tuple[int, ...], torch.Tensor], object],
                   configs: Sequence[tuple[int, ...]], weight: torch.Tensor) -> None:
    """Submit the compiles of ``fused`` at each of ``configs`` to the precompile pool."""
    with skinny.compile_only():
        for config in configs:
            fused(config, weight)
    STATS.precompiled += len(configs)


def compile_threads(setting: int) -> int:
    """Threads for :func:`precompile` (``EngineArgs.tuning_compile_threads``): ``setting``,
    or for 0 one per CPU core this process may use, at most 16."""
    if setting > 0:
        return setting
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(16, cores))


@contextlib.contextmanager
def _passing(name: str) -> Iterator[None]:
    global _pass
    if _pass is not None:
        raise RuntimeError(f"tuner pass {name!r} inside pass {_pass!r}")
    _pass = name
    try:
        yield
    finally:
        _pass = None


@contextlib.contextmanager
def precompile(threads: int) -> Iterator[None]:
    """Compile ahead, on ``threads`` threads, the skinny kernels that the ``choose`` calls
    inside this context will need; the context ends when every compile has.

    Inside, ``choose`` decides nothing new: it submits the compiles (every candidate of an
    undecided shape, the chosen config of a decided one) to ``triton.AsyncCompileMode`` and
    returns None, so the caller runs its unfused path. Calling the same code again
    afterwards times the candidates, all compiled by then (Triton's in-memory kernel
    cache). The decisions are those of timing without this pass: the same candidates are
    timed the same way; only when each is compiled changes. The threads overlap where the
    compiler leaves Python: ptxas runs as a subprocess, and native passes that release the
    GIL run side by side (how much that buys shows in ``TuningStats.precompile_s`` against
    ``tuning_compile_threads=1``). A candidate that fails to compile here is compiled again
    when timed, and fails there as it would without this pass."""
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="replaylm-compile") as pool, \
            triton.AsyncCompileMode(pool, ignore_errors=True), _passing("precompile"):
        yield
    STATS.precompile_s += time.perf_counter() - start


def decide_all(run: Callable[[], None], threads: int) -> None:
    """Decide every projection shape that ``run`` (the model's dense calls at each row count
    a graph uses) reaches, compiling on ``threads`` threads.

    With one thread, ``run`` once: each shape compiles and times its candidates in turn.
    Otherwise three passes: ``run`` with every projection on its unfused path (its own
    kernels, norms and SiLU·mul, compile now: inside the precompile pass a launch of an
    uncompiled kernel would wait behind every queued candidate), ``run`` under
    :func:`precompile`, and ``run`` deciding (timing, all compiled)."""
    if threads > 1:
        with _passing("unfused"):
            run()
        with precompile(threads):
            run()
    run()


def pick_tile(timed: Sequence[tuple[tuple[int, ...], float]]) -> tuple[tuple[int, ...], float]:
    """The tile ``_tune`` keeps among ``(config, µs)`` timings: of those within ``TIE`` of
    the fastest, a whole-K tile before a split-K one, then the fewest warps, then the
    fastest."""
    fastest = min(us for _, us in timed)
    return min(((cfg, us) for cfg, us in timed if us <= fastest * (1 + TIE)),
               key=lambda c: (len(c[0]) > 4, c[0][3], c[1]))


def _tune(key: tuple, weights: Sequence[torch.Tensor], unfused: Callable[[torch.Tensor], object],
          fused: Callable[[tuple[int, ...], torch.Tensor], object]) -> Decision:
    """(chosen config or None for the unfused path, its µs, the unfused path's µs).

    Timings within ``TIE`` of each other count as equal, and the lighter choice wins, for
    what timing one shape alone cannot see:

    - among tiles, one without split-K (one launch, where split-K adds its reduction's:
      one graph node fewer, as against the unfused path below);
    - then the one with the fewest warps: in a decode step a projection's programs
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
             for cfg in candidates(m, k, _weight_dtype(key))]
    best, best_us = pick_tile(timed)
    if best_us > baseline * (1 + TIE):
        best, best_us = None, baseline
    log.info("%s linear %dx%dx%d: unfused %.2f us, best %s %.2f us", kind, m, n, k, baseline,
             "unfused" if best is None else f"triton {best}", best_us)
    return best, round(best_us, 2), round(baseline, 2)
