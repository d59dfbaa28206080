"""Skinny-matmul benchmark: the decode projections of the named shapes, cuBLAS against the
engine's weight-streaming Triton kernel, as achieved weight bandwidth (TB/s).

Each kernel is captured 50 times in one CUDA graph and replayed, so launch overhead is out of
the figure (as inside a decode graph); the calls cycle through copies of the weight larger
than L2 together, so weights stream from HBM as in a decode step. ``--sweep`` times every
tile candidate the engine's tuner chooses from and reports the best.

    PYTHONPATH=. python benchmarks/gemv.py --json OUT.json [--sweep]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from replaylm.kernels.skinny import candidate_configs, pick_config, skinny_linear
from replaylm.kernels.tuner import graph_time_us, weight_rotation
from replaylm.model.config import ModelConfig
from replaylm.model.shapes import NAMED_SHAPES, hf_config_from_dict

REPS = 50


def projections(shape: str) -> list[tuple[str, int, int]]:
    cfg = ModelConfig.from_hf(hf_config_from_dict(NAMED_SHAPES[shape]), shape)
    h = cfg.hidden_size
    return [("qkv", cfg.q_size + 2 * cfg.kv_size, h), ("o", h, cfg.q_size),
            ("gate_up", 2 * cfg.intermediate_size, h), ("down", h, cfg.intermediate_size)]


def time_us(fn, weights) -> float:
    return graph_time_us(fn, weights, reps=REPS, trials=5)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen3-0.6b,llama3.2-1b,llama3-8b")
    ap.add_argument("--m", default="1,4,8")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--json", default=None)
    ns = ap.parse_args(argv)
    rows = []
    for shape in ns.shapes.split(","):
        for (name, n, k), m in itertools.product(projections(shape),
                                                 [int(v) for v in ns.m.split(",")]):
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            nbytes = w.numel() * 2
            ws = weight_rotation(w)  # timed calls read their weights from HBM, not L2
            ref = torch.nn.functional.linear(x, w)
            got = skinny_linear(x, w)
            err = (got.float() - ref.float()).abs().max().item()
            t_cublas = time_us(lambda w, x=x: torch.nn.functional.linear(x, w), ws)
            row = {"shape": shape, "proj": name, "m": m, "n": n, "k": k,
                   "max_abs_err": err, "cublas_us": round(t_cublas, 2),
                   "cublas_tbs": round(nbytes / t_cublas / 1e6, 2)}
            if ns.sweep:
                times = {}
                for cfg in candidate_configs(m, k):
                    times[cfg] = time_us(
                        lambda w, x=x, cfg=cfg: skinny_linear(x, w, config=cfg), ws)
                best = min(times, key=times.get)
                row["ours_us"] = round(times[best], 2)
                row["ours_tbs"] = round(nbytes / times[best] / 1e6, 2)
                row["config"] = best
                row["all_us"] = {str(c): round(t, 2) for c, t in times.items()}
            else:
                t_ours = time_us(lambda w, x=x: skinny_linear(x, w), ws)
                row["ours_us"] = round(t_ours, 2)
                row["ours_tbs"] = round(nbytes / t_ours / 1e6, 2)
                row["config"] = pick_config(m, n, k)
            print(json.dumps(row), flush=True)
            rows.append(row)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
