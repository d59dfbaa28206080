"""Weight updates and sleep/wake, timed on one engine (a CUDA GPU).

    PYTHONPATH=. python benchmarks/weight_sync.py --model llama3-8b --json ws.json

One engine on the named shape (dummy weights, ``enable_sleep_mode``) takes its own weights
back under Hugging Face names (``model.loader.to_hf_names``), so every update writes the same
values and outputs must not change:

- ``update_weights`` from CUDA tensors, from pinned CPU tensors and from a safetensors
  directory (written once, then read once so the timed reads come from the page cache);
  each timed ``--repeats`` times, the best and the median reported;
- the seconds start-up's background thread took to pin level 1's host copy
  (``sleep_pin_ahead``; ``--no-pin-ahead``: none, the first sleep pins it);
- ``sleep(level=1)`` then ``wake_up()``, twice (``first`` and ``again``: with the copy
  pinned ahead both only copy; without, the first also pins): seconds, bytes the device got back (its own ``mem_get_info``) against
  the arena's weight + KV bytes, and the graphs captured before and after (never
  recaptured);
- greedy tokens of one prompt before everything and after everything must be equal, and
  batch-1 decode tok/s (best of 3 runs of 256 tokens) before the updates and after the last
  wake is reported with its change.

It prints one line per measurement and writes them with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
from safetensors.torch import save_file

from replaylm import LLM, SamplingParams
from replaylm.model.loader import to_hf_names


def timed(fn, repeats: int) -> dict:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        result = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return {"best_s": min(times), "median_s": statistics.median(times),
            "tensors": result.tensors, "bytes": result.bytes}


def greedy(llm: LLM) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    return llm.generate([[1, 2, 3, 4, 5, 6, 7, 8]], params, use_tqdm=False)[0].outputs[0].token_ids


def decode_tok_s(llm: LLM, tokens: int = 256, repeats: int = 3) -> float:
    """Batch-1 greedy decode speed: the best of ``repeats`` runs of ``tokens`` new tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate([[1, 2, 3, 4, 5, 6, 7, 8]], params, use_tqdm=False)
        best = min(best, time.perf_counter() - t0)
    return tokens / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-dir", action="store_true", help="skip the safetensors-directory update")
    ap.add_argument("--no-pin-ahead", action="store_true",
                    help="pin sleep(level=1)'s host copy at the first sleep, not at start-up")
    ap.add_argument("--json", default=None)
    ns = ap.parse_args()

    llm = LLM(ns.model, load_format="dummy", skip_tokenizer_init=True, enable_sleep_mode=True,
              max_num_seqs=8, sleep_pin_ahead=not ns.no_pin_ahead)
    before = greedy(llm)
    graphs = llm.graph_stats()["num_graphs"]
    # The host copy is pinned at start-up on a background thread (``sleep_pin_ahead``) or
    # by the first sleep; later sleeps reuse it (``memory.sleep``).
    sleeper = llm.engine.runner.sleeper
    sleeper.wait_host()  # before timing anything: the pinning thread competes for the host
    speed_before = decode_tok_s(llm)
    cuda_src = {n: t.clone() for n, t in to_hf_names(llm.engine.runner.model).items()}
    rows: dict[str, dict] = {}
    rows["update_cuda"] = timed(partial(llm.update_weights, cuda_src), ns.repeats)
    cpu_src = {n: t.cpu().pin_memory() for n, t in cuda_src.items()}
    del cuda_src
    torch.cuda.empty_cache()
    rows["update_pinned_cpu"] = timed(partial(llm.update_weights, cpu_src), ns.repeats)
    if not ns.no_dir:
        with tempfile.TemporaryDirectory(prefix="replaylm-ws-") as tmp:
            save_file(cpu_src, str(Path(tmp) / "model.safetensors"))
            llm.update_weights(tmp)  # the first read fills the page cache
            rows["update_dir_cached"] = timed(partial(llm.update_weights, tmp), ns.repeats)
    del cpu_src
    rows["pin_ahead"] = {"seconds": sleeper.pinned_seconds, "on": not ns.no_pin_ahead}
    for cycle in ("first", "again"):
        slept = llm.sleep(level=1)
        woke = llm.wake_up()
        rows[f"sleep_level1_{cycle}"] = {
            "seconds": slept.seconds, "freed_bytes": slept.freed_bytes,
            "weight_kv_bytes": slept.weight_bytes + slept.kv_bytes,
            "freed_share": slept.freed_bytes / max(1, slept.weight_bytes + slept.kv_bytes)}
        rows[f"wake_up_{cycle}"] = {"seconds": woke.seconds, "mapped_bytes": woke.mapped_bytes,
                                    "restored_bytes": woke.restored_bytes}
    after = greedy(llm)
    speed_after = decode_tok_s(llm)
    rows["decode_batch1"] = {"tok_s_before": speed_before, "tok_s_after": speed_after,
                             "change": speed_after / speed_before - 1}
    summary = {"model": ns.model, "rows": rows, "graphs_before": graphs,
               "graphs_after": llm.graph_stats()["num_graphs"], "outputs_equal": before == after}
    for name, row in rows.items():
        print(f"{name:20s} " + "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                         for k, v in row.items()))
    print(f"graphs {graphs} -> {summary['graphs_after']}, outputs equal: {before == after}")
    if ns.json:
        Path(ns.json).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
