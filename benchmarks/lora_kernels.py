"""The LoRA kernels alone, per projection group, at a named shape's sizes (a CUDA GPU).

    PYTHONPATH=. python benchmarks/lora_kernels.py --model llama3.2-1b --json lora-kernels-1b.json

For each group (qkv, o, gate_up, down) and row count, the device µs of one layer's LoRA
delta (``kernels.lora.lora_add``: the shrink over K ranges, then the expand), replayed from a
CUDA graph that cycles through the layers' slot buffers (as a decode step reads each layer's
adapters once), with every row on an adapter (4 slots, round robin) and with every row a
base-model row (slot -1: the cost of launches that return at once), and the shrink's K
ranges per row. Each group's input rows go through its prologue (RMSNorm for qkv and
gate_up, SiLU·mul for down), as in the model.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from replaylm.capture import graph_replay_us
from replaylm.engine.loading import load_model_config
from replaylm.kernels import lora
from replaylm.lora.peft import GROUP_NAMES
from replaylm.lora.slots import LoRASlots


def filled_slots(cfg, rank: int, num_slots: int, device: torch.device) -> LoRASlots:
    """``num_slots`` slots holding random rank-``rank`` adapters on every group."""
    slots = LoRASlots(cfg, num_slots, rank, 64, torch.bfloat16, device)
    g = torch.Generator(device=device).manual_seed(0)
    for name in slots.a:
        a, b = slots.a[name], slots.b[name]
        a.copy_(torch.randn(a.shape, generator=g, device=device) * a.shape[-1] ** -0.5)
        b.copy_(torch.randn(b.shape, generator=g, device=device) * 0.01)
    slots.ranks.fill_(rank)
    slots.scales.fill_(2.0)
    return slots


def time_group(slots: LoRASlots, group: str, rows: int, on_adapters: bool,
               calls: int) -> float:
    """µs of ``lora_add`` for ``rows`` rows of ``group``."""
    g = slots.groups[group]
    dev = slots.device
    width = 2 * g.in_dim if group == "down" else g.in_dim
    x = torch.randn(rows, width, device=dev, dtype=torch.bfloat16)
    y = torch.zeros(rows, g.out_dim, device=dev, dtype=torch.bfloat16)
    kw: dict = {"silu": True} if group == "down" else {}
    if group in ("qkv", "gate_up"):
        kw = {"norm_weight": torch.ones(g.in_dim, device=dev, dtype=torch.bfloat16),
              "eps": 1e-5}
    tokens = (torch.arange(rows, device=dev, dtype=torch.int32) % slots.max_loras
              if on_adapters else torch.full((rows,), -1, device=dev, dtype=torch.int32))
    ranks = slots.ranks[GROUP_NAMES.index(group)]
    layers = slots.cfg.num_layers

    def add(i: int) -> None:
        layer = i % layers
        lora.lora_add(y, x, slots.a[group][layer], slots.b[group][layer], tokens,
                      ranks[layer], slots.scales, g.segments, **kw)

    return graph_replay_us(add, calls, 3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama3.2-1b")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--rows", default="1,2,4,8,16,32,64")
    p.add_argument("--calls", type=int, default=64, help="calls per captured graph")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("lora_kernels.py needs a CUDA GPU")
    cfg, _ = load_model_config(a.model)
    slots = filled_slots(cfg, a.rank, 4, torch.device("cuda"))
    results = []
    print(f"{'group':>8} {'ranges':>6} {'rows':>5} {'adapters µs':>12} {'base rows µs':>13}")
    for group, g in slots.groups.items():
        ranges = -(-g.in_dim // lora.shrink_split(g.in_dim, slots.max_rank))
        for rows in map(int, a.rows.split(",")):
            on = time_group(slots, group, rows, True, a.calls)
            off = time_group(slots, group, rows, False, a.calls)
            results.append({"group": group, "rows": rows, "ranges": ranges,
                            "adapters_us": on, "base_rows_us": off})
            print(f"{group:>8} {ranges:>6} {rows:>5} {on:>12.2f} {off:>13.2f}")
    out = {"model": a.model, "rank": a.rank, "results": results}
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
