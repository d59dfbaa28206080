"""The environment the package reads: the one place that looks at ``os.environ``.

Every engine setting is a field of ``EngineArgs``; the environment only says where the
on-disk cache lives (``REPLAYLM_CACHE``) and whether Triton runs interpreted (Triton's own
``TRITON_INTERPRET``, which the kernels must follow).
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where the built-in default model's weights and the kernel tuning table are kept:
    ``$REPLAYLM_CACHE``, else ``~/.cache/replaylm``."""
    return Path(os.environ.get("REPLAYLM_CACHE", Path.home() / ".cache" / "replaylm"))


def triton_interpreted() -> bool:
    """Whether Triton kernels run on the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"
