"""Ranks started by torchrun (or by hand with torchrun's variables), on CPU over gloo: the
same tokens as one process, a clear error for a world the settings do not describe, and a
dead rank named by rank 0."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from replaylm import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [[1 + (7 * i + 3 * j) % 250 for j in range(2 + (5 * i) % 19)] for i in range(8)]
KW = dict(num_kv_blocks=40, max_num_seqs=6, max_num_batched_tokens=40, max_model_len=128,
          max_graph_tokens=16, skip_tokenizer_init=True, attention_backend="torch_dense",
          distributed_timeout_s=60.0)
MODES = {"eager": dict(enforce_eager=True),
         "ragged": dict(cuda_graph_mode="ragged", graph_check=1, poison_padding=True)}

# Every rank runs this script; only rank 0 returns from LLM(...) and writes the tokens.
SCRIPT = """
import json, os, signal, sys, time
from replaylm import LLM, SamplingParams
from replaylm.distributed.driver import WorkerError

if __name__ == "__main__":
    ckpt, out, kw = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    llm = LLM(ckpt, **kw)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[1 + (7 * i + 3 * j) % 250 for j in range(2 + (5 * i) % 19)] for i in range(8)]
    if len(sys.argv) > 4:  # kill that process (rank 1), then step: rank 0 must name it
        os.kill(int(sys.argv[4]), signal.SIGKILL)
        start = time.monotonic()
        try:
            llm.generate(prompts, params, use_tqdm=False)
        except WorkerError as e:
            json.dump({"error": str(e), "seconds": time.monotonic() - start}, open(out, "w"))
            sys.exit(3)
        sys.exit(0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    json.dump({"tokens": [o.outputs[0].token_ids for o in outs],
               "agreement_steps": [r["agreement_steps"] for r in llm.graph_stats()["ranks"]]},
              open(out, "w"))
    if kw.get("tensor_parallel_size", 1) > 1:  # else the interpreter's exit shuts down
        llm.shutdown()
"""


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tests.conftest import make_checkpoint

    path = tmp_path_factory.mktemp("torchrun-qwen3")
    # One KV head: both tensor-parallel ranks hold it, each with its 2 query heads.
    make_checkpoint("qwen3", path, seed=3, num_key_value_heads=1)
    return path


@pytest.fixture(scope="module")
def script(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("torchrun-script") / "ranks.py"
    path.write_text(SCRIPT)
    return path


def launch_env() -> dict[str, str]:
    """This environment without a launcher's variables (each test sets its own)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
              "MASTER_PORT"):
        env.pop(k, None)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("tp,dp,mode", [(2, 1, "eager"), (1, 2, "ragged")])
def test_torchrun_ranks_match_one_process(ckpt, script, tmp_path, tp, dp, mode):
    kw = KW | MODES[mode]
    want = [o.outputs[0].token_ids for o in LLM(str(ckpt), **kw).generate(
        PROMPTS, GREEDY, use_tqdm=False)]
    out = tmp_path / "out.json"
    args = kw | dict(tensor_parallel_size=tp, data_parallel_size=dp)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(script), str(ckpt), str(out), json.dumps(args)],
        env=launch_env(), capture_output=True, text=True, timeout=240)
    # Every rank exited 0: the workers stopped when rank 0 shut down.
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(out.read_text())
    assert got["tokens"] == want
    if dp == 2:  # both data-parallel ranks took part in every step's tier agreement
        assert got["agreement_steps"][0] == got["agreement_steps"][1] > 0


def test_world_size_must_match_the_settings(ckpt, monkeypatch):
    for k, v in dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2",
                     MASTER_ADDR="127.0.0.1", MASTER_PORT="1").items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=r"WORLD_SIZE=2 ranks, but EngineArgs\."
                                         r"data_parallel_size=1 × tensor_parallel_size=1 = 1"):
        LLM(str(ckpt), **KW | MODES["eager"])
    with pytest.raises(ValueError, match=r"data_parallel_size=2 × tensor_parallel_size=2 = 4"):
        LLM(str(ckpt), data_parallel_size=2, tensor_parallel_size=2, **KW | MODES["eager"])


def test_a_dead_rank_is_named_by_rank_0(ckpt, script, tmp_path):
    """Two ranks started by hand with torchrun's variables (torchrun itself would stop the
    job when one of its processes dies); rank 0 kills rank 1 and steps."""
    out = tmp_path / "out.json"
    args = json.dumps(KW | MODES["eager"] | dict(tensor_parallel_size=2))
    port = str(_free_port())
    procs = []
    for rank in (1, 0):
        env = launch_env() | dict(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                            LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        extra = [str(procs[0].pid)] if rank == 0 else []
        procs.append(subprocess.Popen([sys.executable, str(script), str(ckpt), str(out), args,
                                       *extra], env=env, text=True,
                                      stderr=subprocess.PIPE if rank == 0 else subprocess.DEVNULL))
    try:
        rank1, rank0 = procs
        err = rank0.communicate(timeout=240)[1]
        assert rank0.returncode == 3, err[-4000:]
        got = json.loads(out.read_text())
        assert "rank 1 (data-parallel rank 0, tensor-parallel rank 1) exited" in got["error"]
        assert got["seconds"] < 20
        assert rank1.wait(timeout=10) == -9
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
