"""The kernel tests' fallback: where Triton was imported compiled-mode before ``tests/kernels``
was collected (see its conftest), the tests there skip and this reruns the whole folder in a
fresh interpreter-mode subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kernels.helpers import CHILD_FLAG, interpreter_active


def test_interpreter_suite_in_subprocess():
    """Fallback when Triton was imported compiled-mode before this folder: rerun it fresh."""
    if interpreter_active():
        pytest.skip("interpreter active in this process; tests run directly")
    env = {**os.environ, "TRITON_INTERPRET": "1", CHILD_FLAG: "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", str(Path(__file__).parent), "-q", "-p", "no:cacheprovider",
         "-m", "not gpu"],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
