"""LoRA adapters against the base model on one engine (a CUDA GPU; ``--tiny`` runs on a CPU).

    PYTHONPATH=. python benchmarks/lora.py --model llama3.2-1b --json lora-1b.json
    PYTHONPATH=. python benchmarks/lora.py --model llama3-8b --json lora-8b.json

The named shape runs with random weights, and random rank-``--rank`` adapters on all seven
projections (q/k/v/o, gate/up/down) are written in PEFT's format for it. Two engines start
one after the other: the base model without LoRA, and the same with ``enable_lora`` (4 slots
of rank ``--rank``). Measured, every figure the best of ``--repeats``:

- output tok/s at batch 1: the base engine; the LoRA engine with a base-model request (the
  cost of the LoRA launches that return at once) and with one adapter;
- output tok/s of ``--batch`` concurrent requests: the base engine, and the LoRA engine with
  the requests spread over 4 adapters;
- graph capture seconds and graph memory (MiB) of both engines, and their ratio; with
  ``--warm-capture`` each engine is first started once and dropped, so both measured engines
  find every kernel compiled (otherwise the first engine's capture also pays the compiles
  that the second then finds cached);
- the copy that makes one adapter resident: host (pinned) to a device slot on a side stream,
  in ms.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path

import torch

from replaylm import LLM, LoRARequest, SamplingParams
from replaylm.engine.loading import load_model_config
from replaylm.lora.peft import load_adapter
from replaylm.model.config import ModelConfig

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(cfg: ModelConfig, path: Path, rank: int, seed: int) -> Path:
    """A random PEFT adapter of ``rank`` on every projection of ``cfg``'s layers."""
    from safetensors.torch import save_file

    h, q, kv, i = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for module, (d_in, d_out) in dims.items():
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, d_in, generator=g)
                                               * d_in**-0.5).to(torch.bfloat16)
            tensors[f"{key}.lora_B.weight"] = (torch.randn(d_out, rank, generator=g)
                                               * 0.01).to(torch.bfloat16)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(MODULES),
        "bias": "none"}))
    return path


def tok_s(llm: LLM, n: int, loras: list, max_tokens: int, prompt_len: int, repeats: int,
          seed: int = 0) -> float:
    """Best output tok/s of ``n`` requests started together, request ``j`` under
    ``loras[j % len(loras)]``."""
    g = torch.Generator().manual_seed(seed)
    vocab = llm.model_config.vocab_size
    prompts = [torch.randint(10, vocab - 10, (prompt_len,), generator=g).tolist()
               for _ in range(n)]
    reqs = [loras[j % len(loras)] for j in range(n)]
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts, sp, use_tqdm=False, lora_request=reqs)  # warm-up, adapters resident
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False, lora_request=reqs)
        best = max(best, n * max_tokens / (time.perf_counter() - t0))
    return best


def resident_ms(llm: LLM, request: LoRARequest, repeats: int) -> float | None:
    """Best ms to copy one adapter from pinned host memory into a device slot on a side
    stream (the manager's path); None on a CPU."""
    runner = llm.engine.runner
    if runner.device.type != "cuda":
        return None
    slots = runner.lora_slots
    adapter = load_adapter(request, runner.cfg, slots.max_rank, slots.dtype, pin=True)
    stream = torch.cuda.Stream(runner.device)
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize(runner.device)
        t0 = time.perf_counter()
        with torch.cuda.stream(stream):
            slots.load(slots.max_loras - 1, adapter)
        stream.synchronize()
        best = min(best, (time.perf_counter() - t0) * 1e3)
    return best


def _free_memory() -> None:
    """Give a dropped engine's memory back before the next engine starts (and sizes its KV
    pool from what is free)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama3.2-1b")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="the default model on a CPU, small")
    p.add_argument("--warm-capture", action="store_true",
                   help="start each engine once before the measured ones (compiled kernels)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    kw: dict = dict(load_format="dummy", max_num_seqs=max(a.batch, 1), skip_tokenizer_init=True,
                    max_model_len=a.prompt_len + a.max_tokens + 16)
    model = a.model
    if a.tiny:
        model, a.batch, a.max_tokens, a.repeats = "default", 8, 8, 1
        kw |= dict(device="cpu", num_kv_blocks=64, max_num_seqs=8,
                   max_model_len=a.prompt_len + a.max_tokens + 16)
    cfg, _ = load_model_config(model)
    out: dict = {"model": model, "rank": a.rank, "batch": a.batch, "max_tokens": a.max_tokens,
                 "warm_capture": a.warm_capture}
    with tempfile.TemporaryDirectory() as tmp:
        loras = [LoRARequest(f"a{i}", i + 1, str(write_adapter(cfg, Path(tmp) / f"a{i}",
                                                               a.rank, i)))
                 for i in range(5)]
        engines = (("base", {}), ("lora", dict(enable_lora=True, max_loras=4,
                                                 max_lora_rank=a.rank)))
        if a.warm_capture:
            for _, extra in engines:
                LLM(model, **kw, **extra)  # started, so its kernels are compiled; dropped
                _free_memory()
        for name, extra in engines:
            llm = LLM(model, **kw, **extra)
            stats = llm.graph_stats()
            res = {"capture_seconds": stats["capture_seconds"], "graph_mib": stats["graph_mib"],
                   "num_graphs": stats["num_graphs"]}
            res["batch1_base_tok_s"] = tok_s(llm, 1, [None], a.max_tokens, a.prompt_len,
                                             a.repeats)
            res["batchN_base_tok_s"] = tok_s(llm, a.batch, [None], a.max_tokens,
                                             a.prompt_len, a.repeats)
            if name == "lora":
                res["batch1_adapter_tok_s"] = tok_s(llm, 1, loras[:1], a.max_tokens,
                                                    a.prompt_len, a.repeats)
                res["batchN_4_adapters_tok_s"] = tok_s(llm, a.batch, loras[:4], a.max_tokens,
                                                       a.prompt_len, a.repeats)
                res["resident_ms"] = resident_ms(llm, loras[4], max(3, a.repeats))
                res["fallbacks"] = llm.graph_stats()["fallbacks"]
            out[name] = res
            del llm
            _free_memory()
    base, lora = out["base"], out["lora"]
    out["batch1_slowdown"] = 1 - lora["batch1_adapter_tok_s"] / base["batch1_base_tok_s"]
    out["batchN_slowdown"] = 1 - lora["batchN_4_adapters_tok_s"] / base["batchN_base_tok_s"]
    out["capture_ratio"] = lora["capture_seconds"] / max(base["capture_seconds"], 1e-9)
    out["graph_mib_ratio"] = lora["graph_mib"] / max(base["graph_mib"], 1e-9)
    print(json.dumps(out, indent=2))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
