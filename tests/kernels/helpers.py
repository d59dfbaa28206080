"""Shared by the kernel tests in ``tests/kernels``: whether Triton runs interpreted here, and a
rotary cos/sin table."""

from __future__ import annotations

import pytest
import torch

# Set in the interpreter-mode subprocess that ``test_interpreter.py`` starts (see conftest.py).
CHILD_FLAG = "REPLAYLM_KERNEL_TESTS_CHILD"


def interpreter_active() -> bool:
    """Whether Triton was first imported in interpreter mode in this process (skips the caller
    where Triton is not installed)."""
    triton = pytest.importorskip("triton")
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(triton.language.sum, InterpretedFunction)


def rope_table(max_pos: int, d: int) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(max_pos).float(), inv)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)
