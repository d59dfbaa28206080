"""The kernel tuner's decisions on disk, so a restart skips the timing runs.

One JSON file (``env.cache_dir() / "linear_tuning.json"``) maps a key naming the GPU model,
the torch and Triton versions, the PDL mode, a digest of the kernel sources and the shape to
the decision ``[config or null, its µs, the unfused path's µs]``. Entries made for other
kernel sources are stale and dropped on the next save.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
import triton

from replaylm.env import cache_dir
from replaylm.kernels import pdl

log = logging.getLogger(__name__)

#: A tuner decision: (skinny-kernel config, or None for the unfused path; its µs; the
#: unfused path's µs).
Decision = tuple[tuple[int, int, int, int] | None, float, float]


class TuningCache:
    """Tuner decisions on disk for kernel sources ``revision`` (loaded on first use)."""

    def __init__(self, revision: str, path: Path | None = None) -> None:
        self.revision = revision
        self.path = path if path is not None else cache_dir() / "linear_tuning.json"
        self._entries: dict[str, list] | None = None

    @staticmethod
    def shape_key(key: tuple) -> str:
        """The shape part of an entry's key: ``kind|MxNxK|dtype|bias``."""
        kind, m, n, k, dtype, bias = key
        return f"{kind}|{m}x{n}x{k}|{dtype}|{bias}"

    def _key(self, key: tuple, device: torch.device) -> str:
        gpu = torch.cuda.get_device_name(device)
        return (f"{gpu}|torch {torch.__version__}|triton {triton.__version__}|pdl {pdl.mode()}|"
                f"src {self.revision}|{self.shape_key(key)}")

    def _load(self) -> dict[str, list]:
        if self._entries is None:
            try:
                entries = json.loads(self.path.read_text())
            except (OSError, ValueError):
                entries = {}
            current = f"|src {self.revision}|"
            self._entries = {k: v for k, v in entries.items() if current in k}
        return self._entries

    def lookup(self, key: tuple, device: torch.device) -> Decision | None:
        hit = self._load().get(self._key(key, device))
        if hit is None:
            return None
        config, ours, unfused = hit
        return (tuple(config) if config is not None else None), ours, unfused

    def store(self, key: tuple, device: torch.device, decision: Decision) -> None:
        entries = self._load()
        entries[self._key(key, device)] = list(decision)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(entries, indent=0))
            tmp.replace(self.path)  # atomic: a concurrent reader never sees half a file
        except OSError as e:  # a read-only home only costs re-tuning next time
            log.debug("cannot save linear tuning: %s", e)
