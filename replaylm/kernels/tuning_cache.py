"""The kernel tuner's decisions on disk: the user's cache, and the tables shipped with replaylm.

Both are one JSON object mapping an entry key to the decision ``[config or null, its µs, the
unfused path's µs]``. The key names everything the decision is valid for: the GPU model, the
torch and Triton versions, the PDL mode, a digest of the kernel sources and decision rule
(``tuner.kernels_revision``), and the shape (``validity`` + ``shape_key``). A decision for
another GPU, version, PDL mode or kernel source is never used.

- The user's cache (``env.cache_dir() / "linear_tuning.json"``) holds what this machine
  measured, so a restart skips the timing runs. Entries made for other kernel sources are
  dropped on the next save.
- A shipped table (``replaylm/kernels/tuned/<gpu>.json``, package data, one file per GPU
  model) holds what the engine measured on that GPU model on a lab machine, in the same
  format (``benchmarks/tuning_table.py`` builds it from user caches). It is read only.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import torch
import triton

from replaylm.env import cache_dir
from replaylm.kernels import pdl

log = logging.getLogger(__name__)

#: A tuner decision: (skinny-kernel config (``skinny._launch``), or None for the unfused
#: path; its µs; the unfused path's µs).
Decision = tuple[tuple[int, ...] | None, float, float]

#: Where the shipped tables live (package data).
SHIPPED_DIR = Path(__file__).resolve().parent / "tuned"


def validity(gpu: str, revision: str) -> str:
    """The part of an entry key that says what the decision is valid for: the GPU model,
    torch and Triton versions, PDL mode and kernel revision of this process."""
    return (f"{gpu}|torch {torch.__version__}|triton {triton.__version__}|pdl {pdl.mode()}|"
            f"src {revision}|")


def shape_key(key: tuple) -> str:
    """The shape part of an entry's key: ``kind|MxNxK|dtype|bias``."""
    kind, m, n, k, dtype, bias = key
    return f"{kind}|{m}x{n}x{k}|{dtype}|{bias}"


def revision_of(entry_key: str) -> str | None:
    """The kernel revision an entry key was made for (None when the key has none)."""
    found = re.search(r"\|src ([^|]+)\|", entry_key)
    return found.group(1) if found else None


def gpu_of(entry_key: str) -> str:
    """The GPU model an entry key was made for."""
    return entry_key.split("|", 1)[0]


def gpu_slug(gpu: str) -> str:
    """A file-name form of a GPU model name: ``NVIDIA H200`` -> ``nvidia-h200``."""
    return re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-") or "unknown"


def shipped_path(gpu: str, directory: Path | None = None) -> Path:
    """The shipped table for GPU model ``gpu``."""
    return (directory or SHIPPED_DIR) / f"{gpu_slug(gpu)}.json"


def read_entries(path: Path) -> dict[str, list]:
    """The entries of a cache or table file; empty when it is missing or not a JSON object."""
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


class TuningCache:
    """Tuner decisions on disk for kernel sources ``revision`` (loaded on first use).

    ``path``: the file (default: the user's cache). ``read_only``: a shipped table, never
    written."""

    def __init__(self, revision: str, path: Path | None = None, read_only: bool = False) -> None:
        self.revision = revision
        self.path = path if path is not None else cache_dir() / "linear_tuning.json"
        self.read_only = read_only
        self._entries: dict[str, list] | None = None

    def entry_key(self, key: tuple, gpu: str) -> str:
        return validity(gpu, self.revision) + shape_key(key)

    def _load(self) -> dict[str, list]:
        if self._entries is None:
            self._entries = {k: v for k, v in read_entries(self.path).items()
                             if revision_of(k) == self.revision}
        return self._entries

    def __len__(self) -> int:
        return len(self._load())

    def lookup(self, key: tuple, gpu: str) -> Decision | None:
        """The decision stored for shape ``key`` on GPU model ``gpu`` in this process's
        versions and PDL mode, or None."""
        hit = self._load().get(self.entry_key(key, gpu))
        if hit is None:
            return None
        config, ours, unfused = hit
        return (tuple(config) if config is not None else None), ours, unfused

    def store(self, key: tuple, gpu: str, decision: Decision) -> None:
        if self.read_only:
            raise ValueError(f"{self.path} is a shipped tuning table (read only)")
        entries = self._load()
        entries[self.entry_key(key, gpu)] = list(decision)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(entries, indent=0))
            tmp.replace(self.path)  # atomic: a concurrent reader never sees half a file
        except OSError as e:  # a read-only home only costs re-tuning next time
            log.debug("cannot save linear tuning: %s", e)
