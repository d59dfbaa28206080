"""A model runner's start-up: device and dtype, the attention backend, programmatic dependent
launch, the tensor-parallel all-reduce, kernel tuning and compile plans (``RunnerStartup``,
a base of ``ModelRunner``)."""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from replaylm.attention.backend import AttentionBackend
from replaylm.attention.torch_dense import TorchDenseAttentionBackend
from replaylm.attention.torch_ref import TorchAttentionBackend
from replaylm.graphs.policy import attention_backend_name
from replaylm.kernels import compile_plan, jit_clock
from replaylm.sampling.sampler import sample

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"EngineArgs.device={name!r} but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def make_attention_backend(requested: str, device: torch.device, mode: str) -> AttentionBackend:
    """The attention backend for ``mode`` (``graphs.policy.attention_backend_name``)."""
    triton_backend = None
    if requested == "triton" or (requested == "auto" and device.type == "cuda"):
        try:
            from replaylm.attention.triton_backend import TritonAttentionBackend as triton_backend
        except ImportError as e:
            log.debug("Triton attention does not import: %s", e)
    name = attention_backend_name(requested, device.type, mode, triton_backend is not None)
    if name == "triton":
        return triton_backend()
    return TorchDenseAttentionBackend() if name == "torch_dense" else TorchAttentionBackend()


class RunnerStartup:
    """The start-up steps of ``ModelRunner`` that configure kernels, each run once by its
    ``__init__``. They read the runner's ``args``, ``cfg``, ``device``, ``dtype``, ``attn``,
    ``model``, ``policy``, ``tp``, ``graph_mode`` and ``sampler``."""

    #: Whether the graphs get a tail graph per tier, for steps that fill structured-output
    #: masks while their forward runs (``graphs.whole``); a draft model samples none.
    split_tails = True
    #: Whether a step's tail samples every row by its slot's settings (``graphs.whole``); a
    #: draft model's takes the argmax and draws its proposals itself (``engine.draft_model``).
    samples_in_tail = True

    def _configure_all_reduce(self) -> dict | None:
        """Under tensor parallel, decide how the group sums (``EngineArgs.all_reduce_backend``,
        ``model.allreduce``: measured now, before KV sizing and capture); the report, or None
        without a group."""
        tp = self.tp
        if tp is None or tp.size == 1 or tp.group is None:
            return None
        report = tp.reducer.configure(self.args.all_reduce_backend, tp.group,
                                      self.cfg.hidden_size, self.dtype, self.device)
        if tp.rank == 0:
            log.info("tensor-parallel all-reduce (%s): %s; %s; latency (us) by tokens: %s",
                     report["setting"], report["summary"], report["reason"],
                     report["latency_us"] or "not measured")
        return report

    def _plan_key(self) -> str:
        return compile_plan.plan_key(torch.cuda.get_device_name(self.device),
                                     dataclasses.asdict(self.cfg), dataclasses.asdict(self.args),
                                     self.graph_mode)

    def _compile_ahead(self) -> compile_plan.PreloadStats | None:
        """On CUDA with ``EngineArgs.compile_ahead``: compile, on a thread pool, the kernel
        variants an earlier start with these shapes and settings compiled (``kernels.
        compile_plan``), before anything launches them; None otherwise."""
        if self.device.type != "cuda" or not self.args.compile_ahead:
            return None
        from replaylm.kernels import tuner

        entries, source = compile_plan.read(self._plan_key())
        if not entries:
            return None
        threads = tuner.compile_threads(self.args.tuning_compile_threads)
        try:
            stats = compile_plan.preload(entries, threads)
        except Exception as e:  # noqa: BLE001 - without the plan the launches compile as usual
            log.warning("compile plan %s not preloaded: %s", source, e)
            return None
        stats.source = str(source)
        log.info("compile plan %s: %d kernels compiled ahead on %d threads in %.2f s "
                 "(%d skipped, %d refused)", source, stats.submitted, threads, stats.seconds,
                 stats.skipped, stats.refused)
        return stats

    def _save_compile_plan(self) -> None:
        """Write the kernel variants this start compiled as its compile plan (on CUDA)."""
        if self.device.type != "cuda" or not self.args.compile_ahead:
            return
        try:
            compile_plan.save(self._plan_key())
        except OSError as e:  # a read-only cache directory: the next start compiles as usual
            log.warning("compile plan not saved: %s", e)

    def _configure_pdl(self) -> bool:
        """Apply ``EngineArgs.pdl`` to the Triton kernels (process-wide); returns whether
        they launch with PDL."""
        if self.attn.name != "triton":
            if self.args.pdl == "on":
                raise ValueError("EngineArgs.pdl='on' needs the Triton kernels (CUDA with "
                                 "attention_backend triton or auto)")
            return False
        from replaylm.kernels import pdl

        return pdl.configure(self.args.pdl)

    def _tune_kernels(self) -> float:
        """Decide the projections' kernels (``kernels.tuner``) at every row count a graph
        tier can run them with, before capture, so capture time is capture alone: the model
        runs each of its dense calls at that size (``tuner.decide_all``: the kernels the
        decisions need compile ahead on a thread pool, then what neither the user's cache
        nor the shipped table decides is timed). Sets ``tuning`` (``TuningStats``) and
        ``tune_jit``; returns the seconds spent."""
        self.tuning = None
        self.tune_jit = jit_clock.JitTotals()
        if self.model.kernels is None:
            return 0.0
        from replaylm.kernels import tuner
        from replaylm.kernels.skinny import MAX_M

        jit_before, stats_before = self._jit_snapshot(), tuner.STATS.copy()
        start = time.perf_counter()
        tuner.configure(shipped_table=self.args.shipped_tuning_table)
        tiers = self.policy.decode_tiers + self.policy.token_tiers
        sizes = sorted({t for t in tiers if t <= MAX_M} | {1})
        threads = tuner.compile_threads(self.args.tuning_compile_threads)
        tuner.decide_all(lambda: [self.model.run_dense_calls(m) for m in sizes], threads)
        seconds = time.perf_counter() - start
        self.tuning = tuner.STATS.since(stats_before)
        self.tune_jit = self._jit_snapshot().since(jit_before)
        log.info("projection kernels for %d row counts in %.2f s: decisions %s; %d kernels "
                 "compiled ahead on %d threads in %.2f s, %d candidates timed in %.2f s",
                 len(sizes), seconds, dict(self.tuning.sources), self.tuning.precompiled,
                 threads, self.tuning.precompile_s, self.tuning.candidates_timed,
                 self.tuning.timing_s)
        return seconds

    def _jit_snapshot(self) -> jit_clock.JitTotals:
        """Triton compile totals so far (``kernels.jit_clock``; counted on CUDA only)."""
        if self.device.type == "cuda":
            jit_clock.install()
        return jit_clock.snapshot()

    def _warm_sampler(self) -> None:
        """Build the sampler's cached tables now, not inside a step that may be captured."""
        logits = torch.zeros(1, self.cfg.vocab_size, device=self.device)
        zeros = torch.zeros(1, dtype=torch.int64, device=self.device)
        sample(logits, zeros, zeros, self.sampler.state, all_greedy=False, need_filter=True)
