"""Routed-expert microbenchmark: routing and the expert kernels of one MoE layer at decode
batch sizes, each path and tile candidate as CUDA-graph replays, in GB/s of expert weights.

For each expert shape and token count ``T`` it times:

- routing: the torch reference on the device (``ref.route_topk``: softmax, top-k,
  normalisation) against the fused kernel (``moe_route.route_topk``);
- the experts: the grouped path (``moe.fused_moe``: grouping by expert, then grouped GEMMs)
  and the per-assignment GEMVs (``moe_decode.gemv_moe``) with the tiles ``pick_config``
  picks, and (at ``--sweep-tokens``) each of the GEMVs' two kernels with every tile of
  ``moe_decode.candidates`` and the picked one;
- the routed step as the engine runs it (``ops.route_topk`` + ``ops.fused_moe``, which
  switches paths at ``moe_decode.MAX_ASSIGNMENTS``) against the grouped step it replaces
  (reference routing + grouped kernels).

Each call of a timed graph takes another random routing and another copy of the layer's
experts (together larger than L2), so weights stream from HBM as in a decode step. GB/s
(and ``of_copy``, its share of the device's copy bandwidth, measured first) counts the
weight bytes of the distinct experts each routing chose (what any path must
read); the per-assignment path may read repeats, which then come from L2 at best. The
summary names the fastest path per ``T``, the best tile of each GEMV against the picked
one, and the largest ``T`` at which the GEMVs beat the grouped path.

``--grouped-sweep`` times only the grouped path's launch configs (``moe.GroupedConfig``), at
``--grouped-tokens``: for each ``BLOCK_M`` of ``moe.BLOCK_MS`` the grouping (one launch,
``moe_align.align_kernel``, against the torch ops, ``align_reference``) and each GEMM
kernel with every tile of ``moe.TILE_CANDIDATES`` (in GB/s of its distinct experts' weight
bytes; ``max_diff``: its largest difference from the default tile's output, which is
rounding only); then the whole path (grouping, both GEMMs, the sum) with the picked config
and with the best of each kernel at the ``BLOCK_M`` whose sum is least. The summary gives,
per shape and ``T``, the mean assignments per expert (``pick_config``'s key), the best
config as a ``moe.CONFIGS`` entry, and its time against the picked one.

    PYTHONPATH=. python benchmarks/moe.py --json moe.json
    PYTHONPATH=. python benchmarks/moe.py --grouped-sweep --json moe_grouped.json
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import astuple

import torch
import triton

from replaylm.kernels import moe, moe_align, moe_decode, moe_route, ops, ref
from replaylm.kernels.tuner import graph_time_us
from replaylm.model.config import ModelConfig
from replaylm.model.shapes import NAMED_SHAPES, hf_config_from_dict

CALLS = 24  # calls per timed graph, each on its own routing
COPIES = 3  # copies of the layer's experts the calls cycle through
DEVICE = "cuda"


def expert_shape(name: str) -> dict:
    cfg = ModelConfig.from_hf(hf_config_from_dict(NAMED_SHAPES[name]), name)
    return {"experts": cfg.num_experts, "top_k": cfg.num_experts_per_tok,
            "hidden": cfg.hidden_size, "inter": cfg.moe_intermediate_size,
            "normalize": cfg.norm_topk_prob}


class Layer:
    """``COPIES`` copies of one layer's experts, ``CALLS`` routings of ``T`` tokens."""

    def __init__(self, shape: dict, t: int, dtype: torch.dtype, seed: int) -> None:
        dev = torch.device(DEVICE)
        g = torch.Generator(device=dev).manual_seed(seed)
        e, h, i, k = shape["experts"], shape["hidden"], shape["inter"], shape["top_k"]
        self.w_gate_up = [torch.randn(e, 2 * i, h, generator=g, device=dev, dtype=dtype) * 0.02
                          for _ in range(COPIES)]
        self.w_down = [torch.randn(e, h, i, generator=g, device=dev, dtype=dtype) * 0.02
                       for _ in range(COPIES)]
        self.x = torch.randn(t, h, generator=g, device=dev, dtype=dtype)
        self.logits = [torch.randn(t, e, generator=g, device=dev, dtype=dtype)
                       for _ in range(CALLS)]
        routes = [ref.route_topk(lg, k, shape["normalize"]) for lg in self.logits]
        self.weights = [w for w, _ in routes]
        self.ids = [ids for _, ids in routes]
        self.inter = [torch.randn(t * k, i, generator=g, device=dev, dtype=dtype)
                      for _ in range(CALLS)]
        distinct = sum(ids.unique().numel() for ids in self.ids) / CALLS
        size = torch.finfo(dtype).bits // 8
        self.gate_up_bytes = distinct * 2 * i * h * size
        self.down_bytes = distinct * h * i * size
        self.distinct = distinct

    def args(self, n: int) -> tuple:
        c = n % COPIES
        return self.x, self.w_gate_up[c], self.w_down[c], self.weights[n], self.ids[n]


def time_calls(fn) -> float:
    """µs of one ``fn(n)`` call, ``n`` the call's index (its routing and expert copy)."""
    return graph_time_us(fn, list(range(CALLS)), reps=CALLS, trials=3)


def copy_gbps(nbytes: int = 1 << 30) -> float:
    """The device's copy bandwidth (bytes read + written per second, in GB/s): the ceiling
    a weight stream can approach."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = graph_time_us(lambda s: dst.copy_(s), [src], reps=5, trials=3)
    return 2 * nbytes / us / 1e3


def bench_tokens(name: str, shape: dict, t: int, dtype: torch.dtype, sweep: bool,
                 ceiling: float) -> list[dict]:
    """Every timing of one shape at ``T`` tokens."""
    k, h, i, norm = shape["top_k"], shape["hidden"], shape["inter"], shape["normalize"]
    layer = Layer(shape, t, dtype, seed=t)
    both = layer.gate_up_bytes + layer.down_bytes
    rows = []

    def row(path: str, us: float, nbytes: float, config=None) -> None:
        r = {"shape": name, "T": t, "path": path, "us": round(us, 2),
             "distinct_experts": round(layer.distinct, 1)}
        if nbytes:
            r["GBps"] = round(nbytes / us / 1e3, 1)
            r["of_copy"] = round(nbytes / us / 1e3 / ceiling, 3)
        if config is not None:
            r["config"] = list(config)
        print(json.dumps(r), flush=True)
        rows.append(r)

    row("route:reference", time_calls(lambda n: ref.route_topk(layer.logits[n], k, norm)), 0)
    row("route:fused", time_calls(lambda n: moe_route.route_topk(layer.logits[n], k, norm)),
        0)
    row("experts:grouped", time_calls(lambda n: moe.fused_moe(*layer.args(n))), both)
    dev = torch.device("cuda")
    slots = triton.next_power_of_2(k)
    picked = (moe_decode.pick_config(t * k, i, h, dev, operands=2),
              moe_decode.pick_config(t, h, i, dev, operands=slots))
    row("experts:gemv", time_calls(lambda n: moe_decode.gemv_moe(*layer.args(n))), both,
        [list(c) for c in picked])
    row("step:grouped", time_calls(lambda n: moe.fused_moe(
        *layer.args(n)[:3], *ref.route_topk(layer.logits[n], k, norm))), both)
    row("step:engine", time_calls(lambda n: ops.fused_moe(
        *layer.args(n)[:3], *ops.route_topk(layer.logits[n], k, norm))), both)
    if not sweep:
        return rows
    for cfg in dict.fromkeys(moe_decode.candidates(2, h) + [picked[0]]):
        row("gate_up", time_calls(lambda n, cfg=cfg: moe_decode.gate_up_gemv(
            layer.x, layer.w_gate_up[n % COPIES], layer.ids[n], cfg)),
            layer.gate_up_bytes, cfg)
    for cfg in dict.fromkeys(moe_decode.candidates(slots, i) + [picked[1]]):
        row("down", time_calls(lambda n, cfg=cfg: moe_decode.down_gemv(
            layer.inter[n], layer.w_down[n % COPIES], layer.weights[n], layer.ids[n], cfg)),
            layer.down_bytes, cfg)
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Per (shape, T): the fastest expert path, the fastest step, and each GEMV kernel's
    best tile against the picked one; per shape: the largest T where the GEMVs win."""
    out = []
    for name in dict.fromkeys(r["shape"] for r in rows):
        gemv_wins = []
        for t in dict.fromkeys(r["T"] for r in rows if r["shape"] == name):
            mine = [r for r in rows if r["shape"] == name and r["T"] == t]
            by = {r["path"]: r for r in mine if ":" in r["path"]}
            s = {"shape": name, "T": t,
                 "fastest_experts": min(("experts:grouped", "experts:gemv"),
                                        key=lambda p: by[p]["us"]),
                 "step_grouped_us": by["step:grouped"]["us"],
                 "step_engine_us": by["step:engine"]["us"],
                 "step_engine_GBps": by["step:engine"]["GBps"]}
            if by["experts:gemv"]["us"] < by["experts:grouped"]["us"]:
                gemv_wins.append(t)
            picked = by["experts:gemv"].get("config")
            for idx, kernel in enumerate(("gate_up", "down")):
                cands = [r for r in mine if r["path"] == kernel]
                if not cands:
                    continue
                best = min(cands, key=lambda r: r["us"])
                at_pick = [r for r in cands if r["config"] == picked[idx]]
                s[f"{kernel}_best"] = {"config": best["config"], "us": best["us"],
                                       "GBps": best["GBps"]}
                if at_pick:
                    s[f"{kernel}_picked_over_best"] = round(at_pick[0]["us"] / best["us"], 3)
            print(json.dumps(s), flush=True)
            out.append(s)
        top_k = expert_shape(name)["top_k"]
        largest = max(gemv_wins, default=None)
        line = {"shape": name, "gemv_faster_up_to_T": largest,
                "assignments": largest * top_k if largest else None,
                "MAX_ASSIGNMENTS": moe_decode.MAX_ASSIGNMENTS}
        print(json.dumps(line), flush=True)
        out.append(line)
    return out


def config_source(config: moe.GroupedConfig) -> str:
    """``config`` as it is written in ``moe.CONFIGS``."""
    return (f"GroupedConfig({config.block_m}, Tile{astuple(config.gate_up)}, "
            f"Tile{astuple(config.down)})")


def grouped_sweep(name: str, shape: dict, t: int, dtype: torch.dtype,
                  ceiling: float) -> tuple[list[dict], dict]:
    """The grouped path's configs for one shape at ``T`` tokens: every timing, and the
    summary line."""
    e, k, h, i = shape["experts"], shape["top_k"], shape["hidden"], shape["inter"]
    layer = Layer(shape, t, dtype, seed=t)
    rows = []

    def row(path: str, us: float, nbytes: float, **extra) -> dict:
        r = {"shape": name, "T": t, "path": path, "us": round(us, 2), **extra}
        if nbytes:
            r["GBps"] = round(nbytes / us / 1e3, 1)
            r["of_copy"] = round(nbytes / us / 1e3 / ceiling, 3)
        print(json.dumps(r), flush=True)
        rows.append(r)
        return r

    def diff(a: torch.Tensor, b: torch.Tensor) -> float:
        return round((a.float() - b.float()).abs().max().item(), 5)

    per_block_m = {}
    for bm in moe.BLOCK_MS:
        groups = [moe_align.align(ids, e, bm) for ids in layer.ids]
        kernel_us = time_calls(lambda n, bm=bm: moe_align.align_kernel(layer.ids[n], e, bm))
        torch_us = time_calls(lambda n, bm=bm: moe_align.align_reference(layer.ids[n], e, bm))
        row("align:kernel", kernel_us, 0, block_m=bm)
        row("align:torch", torch_us, 0, block_m=bm)

        def gate_up(n: int, tile: moe.Tile, bm: int = bm, groups: list = groups):
            return moe.grouped_gate_up(layer.x, layer.w_gate_up[n % COPIES], *groups[n], k,
                                       bm, tile)

        inters = [gate_up(n, moe.Tile()) for n in range(CALLS)]

        def down(n: int, tile: moe.Tile, bm: int = bm, groups: list = groups,
                 inters: list = inters):
            return moe.grouped_down(inters[n], layer.w_down[n % COPIES], *groups[n],
                                    layer.weights[n], bm, tile)

        best = {}
        for kernel, fn, nbytes in (("gate_up", gate_up, layer.gate_up_bytes),
                                   ("down", down, layer.down_bytes)):
            want = fn(0, moe.Tile())
            timed = []
            for tile in moe.TILE_CANDIDATES:
                us = time_calls(lambda n, fn=fn, tile=tile: fn(n, tile))
                timed.append(row(f"grouped:{kernel}", us, nbytes, block_m=bm,
                                 tile=list(astuple(tile)), max_diff=diff(fn(0, tile), want)))
            best[kernel] = min(timed, key=lambda r: r["us"])
        per_block_m[bm] = {"align_us": kernel_us, "align_torch_us": torch_us,
                           "gate_up": best["gate_up"], "down": best["down"],
                           "sum_us": round(kernel_us + best["gate_up"]["us"]
                                           + best["down"]["us"], 2)}

    bm = min(per_block_m, key=lambda b: per_block_m[b]["sum_us"])
    best = moe.GroupedConfig(bm, moe.Tile(*per_block_m[bm]["gate_up"]["tile"]),
                             moe.Tile(*per_block_m[bm]["down"]["tile"]))
    picked = moe.pick_config(t * k, e, i, h)
    both = layer.gate_up_bytes + layer.down_bytes
    at = {}
    for label, config in (("picked", picked), ("best", best)):
        at[label] = row(f"experts:{label}", time_calls(
            lambda n, config=config: moe.fused_moe(*layer.args(n), config=config)), both,
            config=config_source(config))
    got = moe.fused_moe(*layer.args(0), config=best)
    want = moe.fused_moe(*layer.args(0), config=picked)
    summary = {"shape": name, "T": t, "assignments_per_expert": round(t * k / e, 2),
               "distinct_experts": round(layer.distinct, 1),
               "picked": {"config": config_source(picked), "us": at["picked"]["us"]},
               "best": {"config": config_source(best), "us": at["best"]["us"],
                        "GBps": at["best"]["GBps"], "of_copy": at["best"]["of_copy"],
                        "max_diff_vs_picked": diff(got, want)},
               "picked_over_best": round(at["picked"]["us"] / at["best"]["us"], 3),
               "per_block_m": {b: {"align_us": round(v["align_us"], 2),
                                   "align_torch_us": round(v["align_torch_us"], 2),
                                   "gate_up": [v["gate_up"]["tile"], v["gate_up"]["us"]],
                                   "down": [v["down"]["tile"], v["down"]["us"]],
                                   "sum_us": v["sum_us"]}
                               for b, v in per_block_m.items()}}
    print(json.dumps(summary), flush=True)
    return rows, summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen1.5-moe-a2.7b,qwen3-30b-a3b")
    ap.add_argument("--tokens", default="1,4,16,64,256")
    ap.add_argument("--sweep-tokens", default="1,4,16,64",
                    help="the token counts at which every tile candidate of the GEMV kernels "
                         "is timed")
    ap.add_argument("--no-sweep", dest="sweep", action="store_false",
                    help="skip timing the tile candidates")
    ap.add_argument("--grouped-sweep", action="store_true",
                    help="time only the grouped path's launch configs, at --grouped-tokens")
    ap.add_argument("--grouped-tokens", default="16,64,256")
    ap.add_argument("--json", default=None)
    ns = ap.parse_args(argv)
    start = time.perf_counter()
    tokens = [int(v) for v in ns.tokens.split(",")]
    sweep_tokens = {int(v) for v in ns.sweep_tokens.split(",")}
    ceiling = copy_gbps()
    print(json.dumps({"copy_GBps": round(ceiling, 1)}), flush=True)
    rows, summary = [], []
    for name in ns.shapes.split(","):
        shape = expert_shape(name)
        if ns.grouped_sweep:
            for t in (int(v) for v in ns.grouped_tokens.split(",")):
                more, line = grouped_sweep(name, shape, t, torch.bfloat16, ceiling)
                rows += more
                summary.append(line)
                torch.cuda.empty_cache()
            continue
        for t in tokens:
            sweep = ns.sweep and t in sweep_tokens
            rows += bench_tokens(name, shape, t, torch.bfloat16, sweep, ceiling)
            torch.cuda.empty_cache()
    if not ns.grouped_sweep:
        summary = summarize(rows)
    for line in summary if ns.grouped_sweep else ():
        print(f"# {line['shape']} T={line['T']} ({line['assignments_per_expert']} per expert): "
              f"{line['best']['config']} {line['best']['us']} us, {line['best']['GBps']} GB/s; "
              f"picked {line['picked']['us']} us")
    seconds = round(time.perf_counter() - start, 1)
    print(f"# {len(rows)} timings in {seconds} s on {torch.cuda.get_device_name()}")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "seconds": seconds,
                       "copy_GBps": round(ceiling, 1),
                       "rows": rows, "summary": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
