"""``replaylm serve`` over worker processes (tensor or data parallel) on CPU, on loopback."""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from replaylm import LLM, SamplingParams
from tests.serve_process import serve_process

ENGINE_FLAGS = ("--enforce-eager", "--num-kv-blocks", "64", "--max-model-len", "256",
                "--distributed-timeout-s", "120")
PROMPTS = [f"The {w} of the matter is" for w in ("heart", "root", "crux", "end")]


def _workers(pid: int) -> list[int]:
    """The worker processes ``pid`` spawned (its children running ``spawn_main``; not
    multiprocessing's resource tracker), read from /proc."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == pid and b"spawn_main" in cmdline:
            kids.append(int(stat.parent.name))
    return kids


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_serve_over_worker_processes_matches_one_engine_and_exits_cleanly(tmp_path):
    """The server over two data-parallel ranks (the driver's multi-rank path: routing, every
    rank's statistics merged into ``/metrics``, both ranks' shutdown). Tensor parallel goes
    through the same driver with one leader; its equalities are in tests/distributed."""
    flags = ("--data-parallel-size", "2")
    llm = LLM("default", device="cpu", enforce_eager=True, num_kv_blocks=64, max_model_len=256)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    log = tmp_path / "serve.log"
    with serve_process(log, *flags, *ENGINE_FLAGS, timeout=180) as (proc, url):
        workers = _workers(proc.pid)
        assert len(workers) == 2, workers

        def complete(prompt: str) -> str:
            r = httpx.post(url + "/v1/completions", timeout=120, json={
                "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        with ThreadPoolExecutor(len(PROMPTS)) as pool:  # at once: both DP ranks get work
            assert list(pool.map(complete, PROMPTS)) == want
        metrics = httpx.get(url + "/metrics", timeout=10).text
        values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
                  if line.startswith("replaylm_")}
        assert values["replaylm_requests_added_total"] == len(PROMPTS)
        assert values["replaylm_generation_tokens_total"] == 8 * len(PROMPTS)
        assert values["replaylm_num_requests_running"] == 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()
    text = log.read_text()
    assert "stopped cleanly" in text and "Traceback" not in text, text
    assert all(_gone(pid) for pid in workers), workers
