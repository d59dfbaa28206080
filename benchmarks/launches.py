"""Count the GPU kernels one eager decode step launches, per decoder layer.

    PYTHONPATH=. python benchmarks/launches.py --model llama3.2-1b [--no-fused-kernels] [--json OUT]

Runs a batch-1 request to its decode phase, then profiles one more ``step()`` with
``torch.profiler`` and counts its CUDA kernels: the total, the total divided by the layer
count, and the most frequent kernel names.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

from replaylm import LLM, SamplingParams
from replaylm.config import EngineArgs


def count_step_kernels(llm: LLM) -> dict:
    core = llm.engine
    core.add_request("probe", [1] * 32, SamplingParams(temperature=0.0, max_tokens=8,
                                                       ignore_eos=True))
    core.step()  # prefill
    core.step()  # a decode step, so the next one is warm
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        core.step()
        torch.cuda.synchronize()
    while core.has_unfinished():
        core.step()
    names = Counter(e.name for e in prof.events() if e.device_type.name == "CUDA")
    total = sum(names.values())
    layers = llm.model_config.num_layers
    return {"kernels_per_step": total, "layers": layers,
            "kernels_per_layer": round(total / layers, 2), "top": names.most_common(12)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    EngineArgs.add_cli_args(parser, model="llama3.2-1b", load_format="dummy",
                            skip_tokenizer_init=True, enforce_eager=True)
    parser.add_argument("--json", default=None)
    ns = parser.parse_args(argv)
    llm = LLM.from_engine_args(EngineArgs.from_cli_args(ns))
    res = count_step_kernels(llm) | {"fused_kernels": ns.fused_kernels, "model": ns.model}
    print(json.dumps(res, indent=1))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
