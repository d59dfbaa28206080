"""The layer order (pyproject.toml's import-linter contracts) holds, and a module that imports
from a layer above its own breaks it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` on the package under ``root``, with ``root``'s pyproject.toml."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
         "sys.exit(lint_imports_command())", "--no-cache"],
        cwd=root, env=env, capture_output=True, text=True, timeout=120)


def test_the_layer_contracts_hold() -> None:
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_an_upward_import_inside_a_function_breaks_the_layers(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "replaylm", tmp_path / "replaylm",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    ref = tmp_path / "replaylm" / "kernels" / "ref.py"
    ref.write_text(ref.read_text() + "\n\ndef _upward():\n"
                   "    from replaylm.entrypoints import LLM\n\n    return LLM\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0
    assert "layers BROKEN" in result.stdout
    assert "replaylm.kernels.ref -> replaylm.entrypoints" in result.stdout


def test_a_cycle_between_sibling_modules_breaks_the_contract(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "replaylm", tmp_path / "replaylm",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    tiers = tmp_path / "replaylm" / "graphs" / "tiers.py"  # policy imports tiers
    tiers.write_text(tiers.read_text() + "\n\ndef _back():\n"
                     "    from replaylm.graphs import policy\n\n    return policy\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0
    assert "no cycles between sibling modules BROKEN" in result.stdout
