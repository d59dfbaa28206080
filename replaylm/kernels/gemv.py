"""Skinny matmul for decode: ``y = x @ W^T (+ b)`` with few rows in ``x`` (batch-1 decode).

At one to a few tokens a projection is a pure weight stream: every weight byte is read once
and used ``M`` times. cuBLAS picks tile shapes made for larger ``M`` and, on the small square
projections of 0.6B-1B models, reaches under half of the H200's bandwidth. This kernel gives
each program a strip of ``BLOCK_N`` weight rows and the whole ``K``: it streams the strip in
``BLOCK_K`` chunks, multiplies each chunk by all ``M`` rows of ``x`` and reduces in fp32. No
split-K, so there are no atomics and the result is bit-for-bit repeatable (graph replays and
their eager re-runs agree exactly).

``skinny_linear`` runs it for ``M <= MAX_M`` and falls back to ``torch.nn.functional.linear``
otherwise; ``skinny_linear_ref`` is the fp32-accumulating torch reference.

Neither wins everywhere (measured on the H200, launch overhead excluded: on Qwen3-0.6B's
o_proj, 1024x2048, cuBLAS takes 12.4 µs and this kernel 3.9 µs; on Llama-3.2-1B's gate_up,
16384x2048, cuBLAS 18.2 µs and this kernel 25 µs). So ``linear``, what the model's layers
call, times both once per shape on the device, each replayed from a CUDA graph, and keeps the
fastest of cuBLAS and a few tile candidates; ``LINEAR_CHOICES`` records every decision.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.language as tl

log = logging.getLogger(__name__)

MAX_M = 8  # above this, cuBLAS' tensor-core tiles win

#: (m, n, k, dtype, has_bias) -> (kernel config, or None for cuBLAS; its µs; cuBLAS µs).
LINEAR_CHOICES: dict[tuple, tuple[tuple[int, int, int, int] | None, float, float]] = {}


def skinny_linear_ref(x: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    y = x.float() @ weight.float().t()
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, stride_xm, stride_wn, stride_ym,
                   K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr,
                   EVEN_K: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    # Products accumulate elementwise; the one cross-thread reduction comes after the loop,
    # so the loop body is loads and FMAs only.
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + tl.arange(0, BLOCK_K)[None, :]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + tl.arange(0, BLOCK_K)[None, :]
    for k0 in range(0, K, BLOCK_K):  # K is a compile-time constant: a model has a few
        if EVEN_N and EVEN_K:
            w = tl.load(w_ptrs + k0, eviction_policy="evict_first")
        else:
            k_ok = (k0 + tl.arange(0, BLOCK_K)) < K
            w = tl.load(w_ptrs + k0, mask=n_mask[:, None] & k_ok[None, :], other=0.0,
                        eviction_policy="evict_first")
        if EVEN_K:
            x = tl.load(x_ptrs + k0, mask=m_mask[:, None], other=0.0)
        else:
            k_ok = (k0 + tl.arange(0, BLOCK_K)) < K
            x = tl.load(x_ptrs + k0, mask=m_mask[:, None] & k_ok[None, :], other=0.0)
        acc += w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :]
    out = tl.sum(acc, axis=2)  # [BM, BN]
    if HAS_BIAS:
        out += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
             out.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


#: Tile candidates (BLOCK_N, BLOCK_K, num_warps) per row-block size; ``linear`` times each.
CANDIDATES: dict[int, list[tuple[int, int, int]]] = {
    1: [(4, 512, 4), (8, 512, 4), (8, 1024, 8), (16, 512, 8), (4, 1024, 4), (2, 1024, 4),
        (8, 256, 4), (16, 256, 4)],
    2: [(4, 256, 4), (8, 256, 4), (4, 512, 8), (8, 512, 8)],
    4: [(4, 128, 4), (4, 256, 8), (8, 128, 4), (8, 256, 8)],
    8: [(2, 128, 4), (4, 128, 4), (4, 128, 8), (8, 64, 4)],
}


def pick_config(m: int, n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) without measuring: the first candidate whose
    strips cover the SMs about twice."""
    block_m = triton.next_power_of_2(max(m, 1))
    cands = CANDIDATES[min(block_m, 8)]
    for bn, bk, warps in cands:
        if triton.cdiv(n, bn) >= 256:
            return block_m, bn, min(bk, triton.next_power_of_2(k)), warps
    bn, bk, warps = min(cands)
    return block_m, bn, min(bk, triton.next_power_of_2(k)), warps


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` ``[M, K]``; the Triton kernel when ``M <= MAX_M``."""
    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_M or m == 0:
        return torch.nn.functional.linear(x, weight, bias)
    if x.stride(1) != 1:
        x = x.contiguous()
    assert weight.stride(1) == 1, "weight rows must be contiguous"
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    bm, bn, bk, warps = config or pick_config(m, n, k)
    _skinny_kernel[(triton.cdiv(n, bn),)](
        x, weight, bias if bias is not None else weight, y, m, n,
        x.stride(0), weight.stride(0), y.stride(0), K=k,
        HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        EVEN_N=n % bn == 0, EVEN_K=k % bk == 0, num_warps=warps,
    )
    return y


def graph_time_us(fn: Callable[[], object], reps: int = 20, trials: int = 3) -> float:
    """Device time of one ``fn()`` call: ``reps`` calls captured in one CUDA graph, best of
    ``trials`` replays, so host launch overhead is excluded (as inside a decode graph)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
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


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The layers' projection: the fastest of cuBLAS and the skinny kernel's tile candidates
    for this shape.

    The choice is measured on the first call of a shape outside graph capture (graph capture
    warms up eagerly first, so every captured shape is decided before its capture) and kept.
    """
    m = x.shape[0]
    if m > MAX_M or m == 0 or not x.is_cuda:
        return torch.nn.functional.linear(x, weight, bias)
    key = (m, weight.shape[0], weight.shape[1], x.dtype, bias is not None)
    choice = LINEAR_CHOICES.get(key)
    if choice is None:
        if torch.cuda.is_current_stream_capturing():
            return torch.nn.functional.linear(x, weight, bias)  # undecided: the safe default
        choice = _TUNING_CACHE.lookup(key, x.device)
        if choice is None:
            choice = _tune(x, weight, bias)
            _TUNING_CACHE.store(key, x.device, choice)
        LINEAR_CHOICES[key] = choice
    config = choice[0]
    if config is not None:
        return skinny_linear(x, weight, bias, config=config)
    return torch.nn.functional.linear(x, weight, bias)


class _TuningCache:
    """Decisions of ``linear`` on disk (``$REPLAYLM_CACHE/linear_tuning.json``), per GPU
    model and torch/triton versions, so a restart skips the timing runs."""

    def __init__(self) -> None:
        self.entries: dict[str, list] | None = None

    @staticmethod
    def _path() -> Path:
        from replaylm.model.loader import cache_dir

        return cache_dir() / "linear_tuning.json"

    @staticmethod
    def _key(key: tuple, device: torch.device) -> str:
        m, n, k, dtype, bias = key
        gpu = torch.cuda.get_device_name(device)
        return f"{gpu}|torch {torch.__version__}|triton {triton.__version__}|{m}x{n}x{k}|{dtype}|{bias}"

    def _load(self) -> dict[str, list]:
        if self.entries is None:
            try:
                self.entries = json.loads(self._path().read_text())
            except (OSError, ValueError):
                self.entries = {}
        return self.entries

    def lookup(self, key: tuple, device: torch.device):
        hit = self._load().get(self._key(key, device))
        if hit is None:
            return None
        config, ours, cublas = hit
        return (tuple(config) if config is not None else None), ours, cublas

    def store(self, key: tuple, device: torch.device, choice) -> None:
        entries = self._load()
        entries[self._key(key, device)] = list(choice)
        try:
            path = self._path()
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(entries, indent=0))
            tmp.replace(path)
        except OSError as e:  # a read-only home only costs re-tuning next time
            log.debug("cannot save linear tuning: %s", e)


_TUNING_CACHE = _TuningCache()


def _tune(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """(best config or None for cuBLAS, its µs, cuBLAS µs)."""
    m, k = x.shape
    n = weight.shape[0]
    cublas = graph_time_us(lambda: torch.nn.functional.linear(x, weight, bias))
    bm = triton.next_power_of_2(m)
    best, best_us = None, cublas
    for bn, bk, warps in CANDIDATES[bm]:
        cfg = (bm, bn, min(bk, triton.next_power_of_2(k)), warps)
        us = graph_time_us(lambda cfg=cfg: skinny_linear(x, weight, bias, config=cfg))
        if us < best_us:
            best, best_us = cfg, us
    log.info("linear %dx%dx%d: cublas %.2f us, best %s %.2f us", m, n, k, cublas,
             "cublas" if best is None else f"triton {best}", best_us)
    return best, round(best_us, 2), round(cublas, 2)
