"""The LoRA kernels alone, per projection group, at a named shape's sizes (a CUDA GPU).

    PYTHONPATH=. python benchmarks/lora_kernels.py --model llama3.2-1b --json lora-kernels-1b.json

Two tables, every figure the device µs of one layer's call, replayed from a CUDA graph that
cycles through the layers' slot buffers (as a decode step reads each layer's adapters once),
with every row on an adapter (4 slots, round robin) or every row a base-model row (slot -1).
Each group's input rows go through its prologue (RMSNorm of the residual add for qkv and
gate_up) up to ``lora.GROUPED_ABOVE`` rows, as in the model; above, where the model's
separate norm has made them, they are plain. down's input is the activated rows gate_up's
epilogue stored.

- ``lora_add`` per group and row count (``--rows``): the shrink over K ranges, then the
  expand (the path above the skinny kernel's rows), and the shrink's K ranges per row.
- The projection with its delta per group at ``--fold-rows`` (default 1 row): the base
  projection alone (``kernels.ops``, its tuned tile; its weights cycle through copies that
  exceed L2, so they stream from HBM, and its bandwidth is printed against the weight
  bytes; gate_up with SiLU·mul in its epilogue, as the model runs it); *separate*: shrink,
  that projection (gate_up without its SiLU·mul), then ``lora_expand`` (three launches);
  *folded*: shrink, then the projection with its LoRA epilogue (``kernels.skinny_lora``: two
  launches), which ``kernels.ops`` runs when the tuned tile is a whole-K skinny tile
  (``tile`` says which ran: ``folded`` or ``separate``); and *folded, base rows*: the folded
  path on slot -1 rows.

``--shrink-ranges 32,8,4`` runs both tables at each value of ``kernels.lora.SHRINK_RANGES``
(the shrink's K ranges per row and segment: the partial sums each consumer adds), and
``--grid-targets 512,100000`` the first table at each value of
``kernels.lora_grouped.GRID_TARGET`` (how many row blocks run side by side above 8 rows).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from replaylm.capture import graph_replay_us
from replaylm.engine.loading import load_model_config
from replaylm.kernels import lora, lora_grouped, ops, ref, skinny_lora, tuner
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
    x = torch.randn(rows, g.in_dim, device=dev, dtype=torch.bfloat16)
    y = torch.zeros(rows, g.out_dim, device=dev, dtype=torch.bfloat16)
    kw: dict = {}
    if group in ("qkv", "gate_up") and rows <= lora.GROUPED_ABOVE:
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


def _inputs(slots: LoRASlots, group: str, rows: int) -> dict:
    """A group's raw input rows (and residual and norm weight for the norm prologue)."""
    g = slots.groups[group]
    dev, bf16 = slots.device, torch.bfloat16
    kw: dict = {"x": torch.randn(rows, g.in_dim, device=dev, dtype=bf16)}
    if group in ("qkv", "gate_up"):
        kw |= {"residual": torch.randn(rows, g.in_dim, device=dev, dtype=bf16),
               "norm_weight": torch.ones(g.in_dim, device=dev, dtype=bf16), "eps": 1e-5}
    return kw


def _project(group: str, inputs: dict, weight: torch.Tensor,
             lora_group: ref.LoRAGroup | None, silu: bool = True) -> torch.Tensor:
    """The group's projection as the model runs it (``kernels.ops``; gate_up with SiLU·mul
    of its output unless ``silu`` is off), with ``lora_group``'s adapters."""
    x = inputs["x"]
    if group in ("qkv", "gate_up"):
        return ops.norm_linear(x, inputs["residual"], inputs["norm_weight"], inputs["eps"],
                               weight, lora=lora_group,
                               silu_out=silu and group == "gate_up")[0]
    return ops.linear(x, weight, lora=lora_group)


def _folds(group: str, rows: int, weight: torch.Tensor) -> bool:
    """Whether ``kernels.ops`` folds the delta at this shape: the tuned tile (decided by
    the first call) is a whole-K skinny tile; where the separate prologue won, the plain
    projection's tile."""
    kind = {"qkv": "norm", "gate_up": "norm"}.get(group, "plain")
    shape = (ops.row_block(rows), weight.shape[0], weight.shape[1], weight.dtype, False)
    choice = tuner.LINEAR_CHOICES.get((kind, *shape))
    if choice is not None and choice[0] is None and kind != "plain":
        choice = tuner.LINEAR_CHOICES.get(("plain", *shape))
    return choice is not None and skinny_lora.foldable(choice[0])


def time_projection(slots: LoRASlots, group: str, rows: int, path: str, on_adapters: bool,
                    calls: int) -> tuple[float, torch.Tensor]:
    """µs of ``group``'s projection at ``rows`` rows along ``path`` (base, separate,
    folded), and its weight."""
    g = slots.groups[group]
    dev = slots.device
    inputs = _inputs(slots, group, rows)
    shrink_kw = {k: v for k, v in inputs.items() if k != "x"}
    weights = tuner.weight_rotation(torch.randn(g.out_dim, g.in_dim, device=dev,
                                                dtype=torch.bfloat16) * g.in_dim**-0.5)
    slots.token_slots[:rows] = (torch.arange(rows, device=dev) % slots.max_loras
                                if on_adapters else -1)
    layers = slots.cfg.num_layers

    def call(i: int) -> None:
        w = weights[i % len(weights)]
        if path == "base":
            _project(group, inputs, w, None)
            return
        adapters = slots.group(i % layers, group)
        if path == "folded":
            _project(group, inputs, w, adapters)
            return
        delta = adapters.shrink(inputs["x"], **shrink_kw)
        y = _project(group, inputs, w, None, silu=False)
        lora.lora_expand(y, delta.s, delta.b, delta.slots, delta.ranks, delta.scales,
                         delta.segments)

    return graph_replay_us(call, calls, 3), weights[0]


def fold_table(slots: LoRASlots, rows_list: list[int], calls: int) -> list[dict]:
    """The projection-with-delta table (module docstring)."""
    results = []
    print(f"{'group':>8} {'rows':>5} {'tile':>9} {'base µs':>8} {'GB/s':>6} {'separate µs':>12} "
          f"{'folded µs':>10} {'saved µs':>9} {'folded, base rows µs':>21}")
    for group in slots.groups:
        for rows in rows_list:
            base, w = time_projection(slots, group, rows, "base", True, calls)
            separate, _ = time_projection(slots, group, rows, "separate", True, calls)
            folded, _ = time_projection(slots, group, rows, "folded", True, calls)
            folded_off, _ = time_projection(slots, group, rows, "folded", False, calls)
            tile = "folded" if _folds(group, rows, w) else "separate"
            gbs = w.numel() * w.element_size() / base / 1e3
            results.append({"group": group, "rows": rows, "tile": tile, "base_us": base,
                            "base_gbs": gbs, "separate_us": separate, "folded_us": folded,
                            "folded_base_rows_us": folded_off})
            print(f"{group:>8} {rows:>5} {tile:>9} {base:>8.2f} {gbs:>6.0f} {separate:>12.2f} "
                  f"{folded:>10.2f} {separate - folded:>9.2f} {folded_off:>21.2f}")
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama3.2-1b")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--rows", default="1,2,4,8,16,32,64")
    p.add_argument("--fold-rows", default="1", help="row counts of the projection table")
    p.add_argument("--calls", type=int, default=64, help="calls per captured graph")
    p.add_argument("--shrink-ranges", default=str(lora.SHRINK_RANGES),
                   help="values of kernels.lora.SHRINK_RANGES to run both tables at")
    p.add_argument("--grid-targets", default=str(lora_grouped.GRID_TARGET),
                   help="values of kernels.lora_grouped.GRID_TARGET to run the first table at")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("lora_kernels.py needs a CUDA GPU")
    cfg, _ = load_model_config(a.model)
    slots = filled_slots(cfg, a.rank, 4, torch.device("cuda"))
    runs = []
    for shrink_ranges in map(int, a.shrink_ranges.split(",")):
        lora.SHRINK_RANGES = shrink_ranges
        print(f"SHRINK_RANGES {shrink_ranges}")
        results = []
        for target in map(int, a.grid_targets.split(",")):
            lora_grouped.GRID_TARGET = target
            print(f"{'group':>8} {'ranges':>6} {'rows':>5} {'adapters µs':>12} "
                  f"{'base rows µs':>13}  (GRID_TARGET {target})")
            for group, g in slots.groups.items():
                ranges = -(-g.in_dim // lora.shrink_split(g.in_dim, slots.max_rank))
                for rows in map(int, a.rows.split(",")):
                    on = time_group(slots, group, rows, True, a.calls)
                    off = time_group(slots, group, rows, False, a.calls)
                    results.append({"group": group, "rows": rows, "ranges": ranges,
                                    "grid_target": target, "adapters_us": on,
                                    "base_rows_us": off})
                    print(f"{group:>8} {ranges:>6} {rows:>5} {on:>12.2f} {off:>13.2f}")
            print()
        fold = fold_table(slots, [int(r) for r in a.fold_rows.split(",")], a.calls)
        runs.append({"shrink_ranges": shrink_ranges, "results": results, "projections": fold})
    out = {"model": a.model, "rank": a.rank, "runs": runs}
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
