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
* signal ``launch_dependents`` right after the wait, so at most the next kernel is staged
  early (not a cascade of waiting kernels holding SM resources).

Kernels launched without PDL (cuBLAS, torch ops) keep full stream ordering on both sides.
CUDA graph capture records PDL launches as programmatic edges, so replays keep the overlap.

``REPLAYLM_PDL=0`` turns it off (for A/B measurements); it is off in the Triton interpreter
and below compute capability 9.0.
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
#: Extra launch keyword arguments of a PDL kernel launch.
LAUNCH: dict[str, bool] = {"launch_pdl": True} if ENABLED else {}


@triton.jit
def wait_for_previous(USE_PDL: tl.constexpr):
    """Block until the previous kernel's writes are visible, then let the next kernel be
    scheduled. A no-op when the kernel was not launched with PDL."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
