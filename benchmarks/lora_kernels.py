"""The LoRA kernels alone, per projection group, at a named shape's sizes (a CUDA GPU).

    PYTHONPATH=. python benchmarks/lora_kernels.py --model llama3.2-1b --json lora-kernels-1b.json

For each group (qkv, o, gate_up, down) and row count, the device µs of one layer's LoRA
delta (``kernels.lora``), replayed from a CUDA graph that cycles through the layers' slot
buffers (as a decode step reads each layer's adapters once): the fused kernel (one launch;
``lora_fused``, up to ``FUSED_MAX_ROWS`` rows) against shrink + expand (two launches), with
every row on an adapter (4 slots, round robin) and with every row a base-model row (slot -1:
the cost of launches that return at once). ``lora_add`` takes the fused kernel up to
``FUSED_MAX_ROWS`` rows: the rows where the fused column stops winning say where that
threshold belongs. Each group's input rows go through its prologue (RMSNorm for qkv and
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
               calls: int) -> dict[str, float | None]:
    """µs of the fused and the two-launch path for ``rows`` rows of ``group``."""
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

    def fused(i: int) -> None:
        layer = i % layers
        lora.lora_fused(y, x, slots.a[group][layer], slots.b[group][layer], tokens,
                        ranks[layer], slots.scales, g.segments, **kw)

    def apart(i: int) -> None:
        layer = i % layers
        s = lora.lora_shrink(x, slots.a[group][layer], tokens, ranks[layer],
                             len(g.segments), **kw)
        lora.lora_expand(y, s, slots.b[group][layer], tokens, ranks[layer], slots.scales,
                         g.segments)

    return {"fused_us": (graph_replay_us(fused, calls, 3) if rows <= lora.FUSED_MAX_ROWS
                         else None),
            "shrink_expand_us": graph_replay_us(apart, calls, 3)}


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
    print(f"{'group':>8} {'rows':>5} {'rows on':>8} {'fused µs':>9} {'shrink+expand µs':>17}")
    for group in slots.groups:
        for rows in map(int, a.rows.split(",")):
            for on_adapters in (True, False):
                res = time_group(slots, group, rows, on_adapters, a.calls)
                results.append({"group": group, "rows": rows,
                                "rows_on": "adapters" if on_adapters else "base", **res})
                fused = "-" if res["fused_us"] is None else f"{res['fused_us']:.2f}"
                print(f"{group:>8} {rows:>5} {results[-1]['rows_on']:>8} {fused:>9} "
                      f"{res['shrink_expand_us']:>17.2f}")
    out = {"model": a.model, "rank": a.rank, "fused_max_rows": lora.FUSED_MAX_ROWS,
           "results": results}
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
