"""The bytes each launch shape of the projection kernels reads and writes, recorded as they
launch (eagerly, in warm-up and capture), so the profiler can show each kernel's achieved
bandwidth beside its time (``bench.profile.chain_share``).

A launch shape is the kernel's name and its grid, as a device trace names a kernel launch.
Two projections that launch one kernel on the same grid with different byte counts make
their shape ambiguous: it then has no figure rather than a wrong one.
"""

from __future__ import annotations

import torch

#: (kernel name, grid padded to three) -> the byte counts recorded for it.
BYTES: dict[tuple[str, tuple[int, ...]], set[int]] = {}


def _shape(name: str, grid: tuple[int, ...] | list[int]) -> tuple[str, tuple[int, ...]]:
    """A launch shape's key: the name and the grid padded to three dimensions."""
    return name, tuple(grid) + (1,) * (3 - len(grid))


def record(name: str, grid: tuple[int, ...], nbytes: int) -> None:
    """Note that a launch of ``name`` on ``grid`` moves ``nbytes``."""
    BYTES.setdefault(_shape(name, grid), set()).add(nbytes)


def lookup(name: str, grid: tuple[int, ...] | list[int]) -> int | None:
    """The bytes a launch of ``name`` on ``grid`` moves; None when unknown or ambiguous."""
    seen = BYTES.get(_shape(name, grid))
    return next(iter(seen)) if seen is not None and len(seen) == 1 else None


def moved(*tensors: torch.Tensor | None) -> int:
    """The bytes of ``tensors`` (each read or written once; None counts nothing)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
