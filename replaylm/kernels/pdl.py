"""Programmatic dependent launch (PDL, Hopper and later) for the decode-path kernels.

In a CUDA graph each kernel node still waits for the previous kernel to drain, then for its
own blocks to be scheduled: about a microsecond per node, which is a large share of a small
model's decode step (a Qwen3-0.6B step runs ~150 kernels of a few µs each). A kernel
launched with PDL may be scheduled while its predecessor is still running; it must then call
``griddepcontrol.wait`` before it reads anything a previous kernel wrote. Our kernels:

* do only dependency-free work before the wait: address math, and reads of what no kernel
  of the step writes (the projection kernel's weight strip, attention's request lookup,
  rotary's positions, table and norm weights, the LoRA kernels' slots and adapter weights);
* wait in every program, before any early exit, so a kernel completes only after its
  predecessor did: the chain of waits orders each kernel after *all* earlier ones;
* write nothing before the wait, with one exception: the LoRA projection right after its
  shrink (``skinny_lora``), which may read its input rows and store the new residual before
  waiting, because the shrink lets it be scheduled only after the shrink's own wait
  (:func:`release_after_wait`), when every kernel before the shrink has completed; it waits
  before it reads the shrink's sums;
* signal ``launch_dependents`` as they start, before the wait: the next kernel may then be
  scheduled as soon as every program of this one has started, so its programs can load
  their weights while this kernel still waits for the one before. Kernels stage ahead only
  as far as SM resources allow. This cannot deadlock: a kernel is launched only once all
  programs of its predecessor are resident, so the oldest unfinished kernel is always
  wholly on the SMs and its own predecessor has finished. Waits never spin on another
  program (split-KV counts arrivals; nobody waits).

Kernels launched without PDL (cuBLAS, torch ops) keep full stream ordering on both sides.
CUDA graph capture records PDL launches as programmatic edges, so replays keep the overlap.

Whether kernels launch with PDL is the engine setting ``EngineArgs.pdl`` (``auto``: on from
compute capability 9.0), applied process-wide by :func:`configure` before any kernel runs,
so eager runs and graph replays agree. It is always off in the Triton interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from replaylm.env import triton_interpreted


def supported() -> bool:
    """Whether this process can launch with PDL: a GPU of compute capability >= 9.0, and
    Triton not interpreted."""
    return (not triton_interpreted() and torch.cuda.is_available()
            and torch.cuda.get_device_capability()[0] >= 9)


#: Whether the kernels launch with PDL (set by :func:`configure`).
ENABLED: bool = supported()
#: Extra launch keyword arguments of a PDL kernel launch.
LAUNCH: dict[str, bool] = {"launch_pdl": True} if ENABLED else {}


def configure(setting: str) -> bool:
    """Apply ``EngineArgs.pdl`` (auto | on | off, validated there); returns whether PDL is
    on. ``on`` where it is unsupported raises ``ValueError``."""
    global ENABLED, LAUNCH
    if setting == "on" and not supported():
        raise ValueError("EngineArgs.pdl='on' needs a GPU of compute capability >= 9.0 "
                         "(and Triton not interpreted): use auto or off")
    ENABLED = setting != "off" and supported()
    LAUNCH = {"launch_pdl": True} if ENABLED else {}
    return ENABLED


def mode() -> str:
    """``on`` or ``off``: kernel timings depend on it, so tuned tiles are kept per mode."""
    return "on" if ENABLED else "off"


@triton.jit
def wait_for_previous(USE_PDL: tl.constexpr):
    """Let the next kernel be scheduled, then block until the previous kernel's writes are
    visible. A no-op when the kernel was not launched with PDL."""
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()


@triton.jit
def release_after_wait(USE_PDL: tl.constexpr):
    """Block until the previous kernel's writes are visible, then let the next kernel be
    scheduled: once it runs, everything before this kernel has completed. The LoRA shrink
    does this so that the projection after it may read its input rows before its own wait
    (``skinny_lora``)."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def release_next(USE_PDL: tl.constexpr):
    """Let the next kernel be scheduled (the first half of :func:`wait_for_previous`)."""
    if USE_PDL:
        gdc_launch_dependents()


@triton.jit
def wait_previous(USE_PDL: tl.constexpr):
    """Block until the previous kernel's writes are visible (the second half of
    :func:`wait_for_previous`)."""
    if USE_PDL:
        gdc_wait()
