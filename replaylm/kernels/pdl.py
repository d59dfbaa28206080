"""Programmatic dependent launch (PDL, Hopper and later) for the decode-path kernels.

In a CUDA graph each kernel node still waits for the previous kernel to drain, then for its
own blocks to be scheduled: about a microsecond per node, which is a large share of a small
model's decode step (a Qwen3-0.6B step runs ~170 kernels of a few µs each). A kernel
launched with PDL may be scheduled while its predecessor is still running; it must then call
``griddepcontrol.wait`` before it reads anything a previous kernel wrote. Our kernels:

* do only dependency-free work before the wait: address math, and reads of what no kernel
  of the step writes (the projection kernel's weight strip, attention's request lookup,
  rotary's positions, table and norm weights);
* wait in every program, before any early exit, so a kernel completes only after its
  predecessor did: the chain of waits orders each kernel after *all* earlier ones;
* signal ``launch_dependents`` as they start, before the wait (``EARLY_TRIGGER``): the
  next kernel may then be scheduled as soon as every program of this one has started, so
  its programs can load their weights while this kernel still waits for the one before.
  Kernels stage ahead only as far as SM resources allow. This cannot deadlock: a kernel is
  launched only once all programs of its predecessor are resident, so the oldest unfinished
  kernel is always wholly on the SMs and its own predecessor has finished. Waits never
  spin on another program (split-KV and the rotary epilogue count arrivals; nobody waits),
  and the chain of waits still orders each kernel after all earlier ones.

Kernels launched without PDL (cuBLAS, torch ops) keep full stream ordering on both sides.
CUDA graph capture records PDL launches as programmatic edges, so replays keep the overlap.

``REPLAYLM_PDL=0`` turns it off and ``REPLAYLM_PDL_EARLY=0`` moves the trigger after the
wait (both for A/B measurements); PDL is off in the Triton interpreter and below compute
capability 9.0.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


def _enabled() -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("REPLAYLM_PDL", "1") == "0":
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


#: Whether the kernels use PDL; fixed at import so eager runs and graph replays agree.
ENABLED: bool = _enabled()
#: Whether programs let the next kernel launch before their own wait (see the module doc).
EARLY_TRIGGER = tl.constexpr(os.environ.get("REPLAYLM_PDL_EARLY", "1") == "1")


def mode() -> str:
    """``off``, ``early`` (trigger before the wait) or ``late`` (after it): kernel timings
    depend on it, so tuned tiles are kept per mode."""
    return "off" if not ENABLED else ("early" if EARLY_TRIGGER else "late")


#: Extra launch keyword arguments of a PDL kernel launch.
LAUNCH: dict[str, bool] = {"launch_pdl": True} if ENABLED else {}


@triton.jit
def wait_for_previous(USE_PDL: tl.constexpr):
    """Let the next kernel be scheduled, then block until the previous kernel's writes are
    visible (the other order with ``REPLAYLM_PDL_EARLY=0``). A no-op when the kernel was not
    launched with PDL."""
    if USE_PDL:
        if EARLY_TRIGGER:
            gdc_launch_dependents()
        gdc_wait()
        if not EARLY_TRIGGER:
            gdc_launch_dependents()
