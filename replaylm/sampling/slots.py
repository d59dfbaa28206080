"""Per-slot scalar settings, written on the host at admission and sent in one copy per step.

Writing ``device_tensor[slot] = value`` costs a host-to-device copy from pageable memory for
each value: about ten per admitted request across the sampling settings. Admitting 256
requests then spent ~60 ms of host time on copies of four bytes each (Llama-3.2-1B on the
H200, ``bench decode --batch-sizes 256``). ``SlotColumns`` keeps each dtype's settings as
the rows of one host matrix and one device matrix; ``set`` writes the host side only and
``flush`` copies every matrix that changed, once, before the step that first reads them.

The device rows are views of matrices allocated once, so graphs that captured their
addresses stay valid. The host matrices are pageable: a non-blocking copy from pageable
memory is staged by the driver before the call returns, so the next ``set`` may overwrite
the host rows at once, even while the copy is still queued behind a step in flight.
"""

from __future__ import annotations

import torch


class SlotColumns:
    """Named per-slot columns (``name -> (dtype, default)``), each a row of its dtype's
    ``[columns, num_slots]`` matrix. ``columns[name]`` is the device row."""

    def __init__(self, num_slots: int, device: torch.device,
                 spec: dict[str, tuple[torch.dtype, float | int]]) -> None:
        self.num_slots = num_slots
        self._where: dict[str, tuple[torch.dtype, int]] = {}
        by_dtype: dict[torch.dtype, list[float | int]] = {}
        for name, (dtype, default) in spec.items():
            defaults = by_dtype.setdefault(dtype, [])
            self._where[name] = (dtype, len(defaults))
            defaults.append(default)
        self._host = {dt: torch.tensor(d, dtype=dt)[:, None].repeat(1, num_slots)
                      for dt, d in by_dtype.items()}
        # A copy even on the CPU, so the host/device contract (flush) is the same there.
        self._device = {dt: h.to(device, copy=True) for dt, h in self._host.items()}
        self._dirty: set[torch.dtype] = set()
        self.columns = {name: self._device[dt][row] for name, (dt, row) in self._where.items()}

    def set(self, slot: int, **values: float | int) -> None:
        """Write ``slot``'s values on the host; they reach the device at the next ``flush``."""
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} out of range [0, {self.num_slots})")
        for name, value in values.items():
            dtype, row = self._where[name]
            self._host[dtype][row, slot] = value
            self._dirty.add(dtype)

    def flush(self) -> None:
        """Copy every matrix written since the last flush to the device (stream-ordered)."""
        for dtype in self._dirty:
            self._device[dtype].copy_(self._host[dtype], non_blocking=True)
        self._dirty.clear()
