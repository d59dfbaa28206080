"""Decode steps with LoRA adapter rows, profiled (a CUDA GPU; ``--device cpu`` for a check).

    PYTHONPATH=. python benchmarks/lora_profile.py --model llama3.2-1b --batch 64 --adapters 4

The named shape runs with random weights on a LoRA engine (4 slots of rank 16) and random
rank-16 adapters on all seven projections (``lora.write_adapter``). ``--batch`` requests of
32 prompt tokens, request ``j`` on adapter ``j % --adapters`` (0: base-model requests), run
once to warm up (adapters resident), then:

- one run of 128 tokens under the step profiler (``replaylm.bench.profile``): per steady
  step (the first, the prefill, left out) the medians of CPU time, GPU busy time and graph
  nodes, and the first three steps as (mode, tokens, CPU ms, GPU busy ms);
- one run of 32 tokens under ``torch.profiler`` (trace in ``--out``): the kernels with the
  most device time and the launch shapes that add the most to the busy time, per decode
  step (the prefill's kernels spread over the steps).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from replaylm import LLM, LoRARequest, SamplingParams
from replaylm.bench.profile import profile_run
from replaylm.engine.loading import load_model_config

sys.path.insert(0, str(Path(__file__).parent))
from lora import write_adapter  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama3.2-1b")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--adapters", type=int, default=4, help="0: base-model requests")
    p.add_argument("--out", default="lora-profile", help="directory of the trace")
    p.add_argument("--device", default=None, help="cpu: a check of the script, no trace")
    a = p.parse_args()
    extra = dict(device="cpu", num_kv_blocks=256) if a.device == "cpu" else {}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    cfg, _ = load_model_config(a.model)
    with tempfile.TemporaryDirectory() as tmp:
        loras = [LoRARequest(f"a{i}", i + 1, str(write_adapter(cfg, Path(tmp) / f"a{i}", 16, i)))
                 for i in range(max(a.adapters, 1))]
        llm = LLM(a.model, load_format="dummy", max_num_seqs=max(a.batch, 1),
                  skip_tokenizer_init=True, max_model_len=200, enable_lora=True, max_loras=4,
                  max_lora_rank=16, **extra)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(10, 1000, (32,), generator=g).tolist() for _ in range(a.batch)]
        reqs = [loras[j % a.adapters] if a.adapters else None for j in range(a.batch)]
        params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
        llm.generate(prompts, params, use_tqdm=False, lora_request=reqs)
        trace = f"{a.out}/{a.model}_b{a.batch}_a{a.adapters}.json"
        result = profile_run(llm, prompts, params, trace_path=trace, trace_tokens=32,
                             lora_request=reqs)
        print("first steps", [(s["mode"], s["tokens"], round(s["cpu_ms"], 3), s["gpu_busy_ms"])
                              for s in result["steps"][:3]])
        print(a.model, a.batch, a.adapters, json.dumps(result["summary"]))
        for name, us, n in result["top_kernels_us_per_token"][:14]:
            print(f"  {us * a.batch:9.2f} us/step {n * a.batch:7.2f}x  {name}")
        for name, us, n, gbs in result["chain_share_us_per_token"][:14]:
            print(f"  adds {us * a.batch:9.2f} us/step {n * a.batch:7.2f}x {gbs}  {name}")


if __name__ == "__main__":
    main()
