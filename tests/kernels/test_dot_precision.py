"""fp32 means fp32: every matrix product in the kernels multiplies float32 operands in IEEE
float32, never TF32 (Triton's default for float32 on NVIDIA GPUs), while bf16 products keep
Triton's default. Checked on the Triton IR each kernel lowers to for an sm_90 target (no GPU
needed); ``tests/gpu/test_kernels_gpu.py`` checks the numbers against float64."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KERNELS_DIR = ROOT / "replaylm" / "kernels"


def test_every_kernel_multiplies_through_the_precise_dot():
    """A raw ``tl.dot`` would take TF32 for float32 operands; only ``kernels/dot.py`` calls it."""
    raw = [f"{path.name}:{i}" for path in sorted(KERNELS_DIR.glob("*.py")) if path.name != "dot.py"
           for i, line in enumerate(path.read_text().splitlines(), 1)
           if re.search(r"\btl\.dot\(", line.split("#")[0])]
    assert raw == []


def test_float32_dots_lower_to_ieee_and_bf16_dots_are_unchanged():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-m", "tests.kernels.dot_ir"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    for key, lines in found.items():
        assert lines, f"{key}: no tt.dot in the kernel's IR"
        for line in lines:
            operand = re.search(r"tensor<[0-9x]+x(\w+)>", line).group(1)
            if key.endswith("/fp32"):
                assert operand == "f32" and "inputPrecision" not in line, (key, line)
            else:  # bf16 operands: Triton's default precision attribute, as before
                assert operand == "bf16" and "inputPrecision = tf32" in line, (key, line)
