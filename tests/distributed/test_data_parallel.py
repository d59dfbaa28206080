"""Data parallelism on CPU: two worker processes over gloo, against one engine."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from replaylm import LLM, SamplingParams
from replaylm.config import EngineArgs
from replaylm.distributed.driver import WorkerError

ROOT = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [[1 + (7 * i + 3 * j) % 250 for j in range(2 + (5 * i) % 19)] for i in range(12)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tests.conftest import make_checkpoint

    path = tmp_path_factory.mktemp("dp-qwen3")
    make_checkpoint("qwen3", path, seed=5)
    return path


def _kw(mode: str) -> dict:
    kw = dict(num_kv_blocks=40, max_num_seqs=6, max_num_batched_tokens=40, max_model_len=128,
              max_graph_tokens=32, skip_tokenizer_init=True, attention_backend="torch_dense",
              distributed_timeout_s=30.0)
    if mode == "eager":
        return kw | dict(enforce_eager=True)
    return kw | dict(cuda_graph_mode=mode, graph_check=1, poison_padding=True)


def _tokens(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_settings_are_validated():
    with pytest.raises(ValueError, match="data_parallel_size"):
        EngineArgs(data_parallel_size=0)
    with pytest.raises(ValueError, match="distributed_timeout_s"):
        EngineArgs(distributed_timeout_s=0)


def test_eager_dp2_matches_dp1_and_a_killed_worker_is_named_within_the_timeout(ckpt):
    want = _tokens(LLM(str(ckpt), **_kw("eager")), PROMPTS)
    with LLM(str(ckpt), data_parallel_size=2, **_kw("eager")) as llm:
        procs = list(llm.engine.procs)
        assert _tokens(llm, PROMPTS) == want
        ranks = llm.graph_stats()["ranks"]
        stats = llm.stats()
        assert stats.requests_finished == len(PROMPTS)
        # Placement by load spread the prompts; every rank took part in every step.
        assert all(r["agreement_steps"] > 0 for r in ranks)
        assert ranks[0]["agreement_steps"] == ranks[1]["agreement_steps"]
        assert stats.prompt_tokens == sum(map(len, PROMPTS))
        # An abort reaches the rank that owns the request.
        llm.engine.add_request("x", PROMPTS[0], SamplingParams(max_tokens=50))
        assert llm.engine.abort("x") and not llm.engine.abort("x")
        assert llm.stats().requests_aborted == 1
        # A worker killed mid-run: the driver names it within the timeout, ends the other.
        os.kill(procs[1].pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerError, match="rank 1 exited"):
            _tokens(llm, PROMPTS)
        assert time.monotonic() - start < llm.engine.timeout_s
        assert not any(p.is_alive() for p in procs)
        with pytest.raises(WorkerError, match="shut down"):
            _tokens(llm, PROMPTS)
    assert not set(procs) & set(multiprocessing.active_children())


def test_ragged_dp2_matches_dp1_and_an_idle_rank_replays_the_agreed_tier(ckpt):
    long_prompt = [[3 + (11 * j) % 240 for j in range(60)]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    single = LLM(str(ckpt), **_kw("ragged"))
    want, want_long = _tokens(single, PROMPTS), _tokens(single, long_prompt, params)
    llm = LLM(str(ckpt), data_parallel_size=2, **_kw("ragged"))
    try:
        assert _tokens(llm, PROMPTS) == want
        before = llm.graph_stats()["ranks"]
        # One request: one rank prefills (two chunks) and decodes it, the other stays idle.
        assert _tokens(llm, long_prompt, params) == want_long
        after = llm.graph_stats()["ranks"]
        # A rank that hangs (stopped) is named within the timeout; every worker is ended.
        llm.engine.timeout_s = 2.0
        os.kill(llm.engine.procs[1].pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(WorkerError, match=r"ranks? \[?(0, )?1\]? did not answer"):
            _tokens(llm, PROMPTS[:2])
        assert time.monotonic() - start < 2.0 + 5.0
    finally:
        llm.shutdown()
        llm.shutdown()  # idempotent
    assert not set(llm.engine.procs) & set(multiprocessing.active_children())

    def delta(rank: int, key: str) -> dict[str, int]:
        a, b = after[rank][key], before[rank][key]
        return {k: a[k] - b.get(k, 0) for k in a if a[k] != b.get(k, 0)}

    busy = 0 if delta(0, "hits") else 1
    idle = 1 - busy
    assert delta(idle, "hits") == {}
    # Every graph step of the busy rank is a dummy replay of the same tier on the idle one.
    assert sum(delta(busy, "hits").values()) >= 10
    assert delta(idle, "dummy_steps") == delta(busy, "hits")
    assert delta(busy, "dummy_steps") == {}
    steps = after[busy]["agreement_steps"] - before[busy]["agreement_steps"]
    assert after[idle]["agreement_steps"] - before[idle]["agreement_steps"] == steps
    padded = after[idle]["agreement_padded_tokens"] - before[idle]["agreement_padded_tokens"]
    assert padded == sum(int(k.split(":")[1]) * n for k, n in delta(busy, "hits").items())
    assert after[busy]["agreement_padded_tokens"] == before[busy]["agreement_padded_tokens"]
    assert not any(p.is_alive() for p in llm.engine.procs)


@pytest.mark.parametrize("pipeline", ["auto", "on"])
def test_speculative_dp2_matches_plain_dp1(ckpt, pipeline):
    """n-gram drafts verified on two ranks (ragged graphs through the stand-in, checked and
    poisoned): the tokens of one plain engine, drafts accepted, and the ranks' counters
    summed. Prompts repeat a span so prompt lookup finds drafts. Pipelined, each rank's
    cohorts take turns while the ranks agree on every step's tier."""
    spans = [[5 + (13 * i + 7 * j) % 200 for j in range(4 + i % 3)] for i in range(6)]
    prompts = [(s * 5)[: 4 + 3 * len(s)] for s in spans]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    want = _tokens(LLM(str(ckpt), **_kw("ragged")), prompts, params)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
            "pipeline": pipeline}
    with LLM(str(ckpt), data_parallel_size=2, speculative_config=spec, **_kw("ragged")) as llm:
        assert _tokens(llm, prompts, params) == want
        st = llm.spec_stats()
        ranks = llm.graph_stats()["ranks"]
    assert st["draft_tokens"] > 0 and st["verify_steps"] > 0
    assert (st["pipelined_steps"] > 0) == (pipeline == "on")
    assert st["num_speculative_tokens"] == 3 and st["budget"] == "fixed"
    assert ranks[0]["agreement_steps"] == ranks[1]["agreement_steps"] > 0


EXIT_SCRIPT = """
import sys
from replaylm import LLM
if __name__ == "__main__":
    llm = LLM(sys.argv[1], data_parallel_size=2, enforce_eager=True, num_kv_blocks=20,
              max_model_len=64, skip_tokenizer_init=True, distributed_timeout_s=30)
    print(" ".join(str(p.pid) for p in llm.engine.procs), flush=True)
"""


def test_interpreter_exit_ends_the_workers(ckpt, tmp_path):
    script = tmp_path / "dp_exit.py"
    script.write_text(EXIT_SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, str(script), str(ckpt)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    pids = [int(p) for p in done.stdout.split()]
    assert len(pids) == 2
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or _is_zombie(pid)


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True
