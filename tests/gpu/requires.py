"""The module-level guard of the GPU kernel tests: skip the module without CUDA, without
Triton, or when the Triton interpreter is active in this process (then nothing would run on
the GPU)."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch


def compiled_triton() -> ModuleType:
    """Triton, compiling for this process's CUDA device; else the calling module is skipped."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA", allow_module_level=True)
    triton = pytest.importorskip("triton")
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(triton.language.sum, InterpretedFunction):
        pytest.skip("Triton interpreter is active in this process", allow_module_level=True)
    return triton
