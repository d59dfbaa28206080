"""Compile plans on the GPU: a start records the kernel variants it compiled, and a start
with a cold Triton cache compiles them all ahead from the plan."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

ROOT = Path(__file__).resolve().parents[2]

START = """
import json, sys
from replaylm import LLM
llm = LLM(sys.argv[1], cuda_graph_mode="ragged", dtype="bfloat16", num_kv_blocks=64,
          max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, max_graph_tokens=64,
          skip_tokenizer_init=True)
runner = llm.engine.runner
plan = runner.compile_plan
print(json.dumps({"plan": None if plan is None else [plan.submitted, plan.skipped,
                                                     plan.refused],
                  "capture_compiled": runner.capture_jit.compiled}))
"""


def _start(ckpt: Path, cache: Path, triton_cache: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), REPLAYLM_CACHE=str(cache),
               TRITON_CACHE_DIR=str(triton_cache))
    done = subprocess.run([sys.executable, "-c", START, str(ckpt)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_start_with_a_cold_triton_cache_compiles_its_kernels_ahead(tmp_path):
    from tests.conftest import make_checkpoint

    ckpt = tmp_path / "ckpt"
    make_checkpoint("llama", ckpt)
    first = _start(ckpt, tmp_path / "cache", tmp_path / "triton-1")
    assert first["plan"] is None and first["capture_compiled"] > 0
    assert list((tmp_path / "cache" / "compile_plans").glob("*.json"))
    second = _start(ckpt, tmp_path / "cache", tmp_path / "triton-2")  # Triton's cache cold
    submitted, skipped, refused = second["plan"]
    assert submitted > 0 and skipped == refused == 0
    # Every variant capture launches was compiled ahead (or by the tuner's own pass).
    assert second["capture_compiled"] == 0
