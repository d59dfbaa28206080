"""Projection tiles timed in the decode chain instead of one kernel at a time.

    python -m replaylm.bench.chain [--model qwen3-0.6b] [--layers 8] [--json out.json]

``gemv.choose`` tunes each batch-1 projection alone: 20 launches of one kernel in a CUDA
graph. In a decode step each projection follows a different kernel. With PDL it streams its
weights before its wait, but only in programs that find registers free beside that kernel
(``bench.ptxas``: on Qwen3-0.6B, no down_proj program fits beside gate/up's). So the tile that
is fastest alone need not be fastest in the chain.

This benchmark builds a model's per-layer projection chain at one row. It runs qkv (with the
residual add and RMSNorm in front), o_proj, gate/up (with the add and norm) and down (with
SiLU·mul), each fed by the one before, over ``--layers`` layers of distinct random weights
(more than L2 holds, so weights come from HBM). Rotary and attention are left out, so here
o_proj follows qkv. The chain is replayed from a CUDA graph. The benchmark starts from the
engine's own choices and improves neighbouring projections jointly (``pair_descent`` over the
skinny-kernel candidates and the unfused path). It then re-times both sets of choices,
interleaved, and reports their median µs per layer. Nothing in the engine changes.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

#: A projection's option: a skinny-kernel tile ``(BLOCK_M, BLOCK_N, BLOCK_K, warps)``, or
#: None for the unfused path (the separate op and ``linear``; cuBLAS for a bare projection).
Option = tuple[int, int, int, int] | None


@dataclass(frozen=True)
class Projection:
    name: str
    kind: str  # "norm" (add + RMSNorm in front), "plain" or "silu" (SiLU·mul in front)
    n: int
    k: int


def pair_descent(options: Sequence[Sequence[Option]], start: Sequence[Option],
                 time_fn: Callable[[list[Option]], float], passes: int = 2,
                 ) -> tuple[list[Option], float, list[tuple[list[Option], float]]]:
    """Minimise ``time_fn`` over one option per slot, neighbours jointly: from ``start``,
    try every combination of slots ``i`` and ``i + 1`` (the last slot pairs with the first:
    the chain wraps to the next layer) with the others held, keep the fastest, go on to the
    next pair; ``passes`` rounds, stopping early once a round changes nothing. A kernel's
    speed in the chain depends mostly on the kernel before it, so pairs find what one slot
    at a time cannot (a slower tile for one projection that lets the next one overlap).
    Returns (best, its time, every distinct trial in order)."""
    seen: dict[tuple, float] = {}
    trials: list[tuple[list[Option], float]] = []

    def timed(opts: list[Option]) -> float:
        key = tuple(opts)
        if key not in seen:
            seen[key] = time_fn(opts)
            trials.append((list(opts), seen[key]))
        return seen[key]

    best = list(start)
    best_t = timed(best)
    n = len(options)
    # Neighbours around the ring; two slots are one pair, one slot is tried alone.
    pairs = [(i, (i + 1) % n) for i in range(n)] if n > 2 else [(0, n - 1)]
    for _ in range(passes):
        changed = False
        for i, j in pairs:
            for a, b in itertools.product(options[i], options[j]):
                trial = list(best)
                trial[i] = a
                trial[j] = b  # for one slot (i == j) this is the option tried
                t = timed(trial)
                if t < best_t:
                    best, best_t, changed = trial, t, True
        if not changed:
            break
    return best, best_t, trials


def projections_of(model: str) -> list[Projection]:
    """The four batch-1 projections of a named shape, in chain order."""
    from replaylm.model.shapes import NAMED_SHAPES

    s = NAMED_SHAPES[model]
    hidden, inter = s["hidden_size"], s["intermediate_size"]
    hq, hkv = s["num_attention_heads"], s["num_key_value_heads"]
    d = s.get("head_dim", hidden // hq)
    return [Projection("qkv", "norm", (hq + 2 * hkv) * d, hidden),
            Projection("o_proj", "plain", hidden, hq * d),
            Projection("gate_up", "norm", 2 * inter, hidden),
            Projection("down", "silu", hidden, inter)]


def options_of(p: Projection) -> list[Option]:
    """The unfused path and every one-row skinny tile ``gemv.choose`` would time."""
    from replaylm.kernels import gemv

    return [None, *gemv.candidate_configs(1, p.k)]


class LayerChain:
    """The projection chain of ``layers`` layers at one row, on the GPU, with random weights."""

    def __init__(self, projections: list[Projection], layers: int, dtype, device, eps: float = 1e-6):
        import torch

        self.p, self.eps = projections, eps
        gen = torch.Generator(device=device).manual_seed(0)

        def rand(*shape):
            return torch.randn(*shape, device=device, dtype=dtype, generator=gen) * 0.02

        self.weights = [[rand(p.n, p.k) for p in projections] for _ in range(layers)]
        hidden = projections[0].k
        self.norms = [[1 + rand(hidden), 1 + rand(hidden)] for _ in range(layers)]
        self.x = rand(1, hidden)
        self.residual = rand(1, hidden)

    def run(self, opts: Sequence[Option]):
        """One pass through every layer; returns the last hidden state and residual."""
        import torch

        from replaylm.kernels import fused, gemv

        h, res = self.x, self.residual
        for w, (ln1, ln2) in zip(self.weights, self.norms, strict=True):
            qkv, res = self._norm(h, res, ln1, w[0], opts[0])
            a = qkv[:, :self.p[1].k]
            if opts[1] is None:
                o = torch.nn.functional.linear(a, w[1])  # cuBLAS
            else:
                o = gemv.skinny_linear(a, w[1], config=opts[1])
            gu, res = self._norm(o, res, ln2, w[2], opts[2])
            if opts[3] is None:
                h = gemv.linear(fused.silu_and_mul(gu), w[3])
            else:
                h = gemv.skinny_silu_linear(gu, w[3], config=opts[3])
        return h, res

    def _norm(self, x, res, ln, w, opt):
        from replaylm.kernels import fused, gemv

        if opt is None:
            return fused._unfused_norm_linear(x, res, ln, self.eps, w, None)
        return gemv.skinny_norm_linear(x, res, ln, self.eps, w, None, config=opt)

    def time_us_per_layer(self, opts: Sequence[Option]) -> float:
        from replaylm.kernels import gemv

        return gemv.graph_time_us(lambda _w: self.run(opts), [None], reps=1, trials=5) / len(
            self.weights)

    def engine_choices(self) -> list[Option]:
        """What the engine picks for each projection (``gemv.choose``: tuned alone, or read
        from the tuning cache)."""
        import torch

        from replaylm.kernels import fused, gemv

        # One eager pass through the engine's own entry points makes every decision.
        h, res = self.x, self.residual
        w, (ln1, ln2) = self.weights[0], self.norms[0]
        qkv, res = fused.norm_linear(h, res, ln1, self.eps, w[0])
        o = gemv.linear(qkv[:, :self.p[1].k], w[1])
        gu, res = fused.norm_linear(o, res, ln2, self.eps, w[2])
        fused.silu_linear(gu, w[3])
        torch.cuda.synchronize()
        dtype = self.x.dtype
        return [gemv.LINEAR_CHOICES[(p.kind, 1, p.n, p.k, dtype, False)][0] for p in self.p]


def main(argv: list[str] | None = None) -> int:
    import torch

    from replaylm.bench.kernels import COPY_CEILING_TBS
    from replaylm.model.shapes import NAMED_SHAPES

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-0.6b", choices=sorted(NAMED_SHAPES))
    ap.add_argument("--layers", type=int, default=8,
                    help="layers of distinct weights in the chain (exceed L2)")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--confirm", type=int, default=5,
                    help="re-timings of the engine's and the chain's choices at the end")
    ap.add_argument("--json", help="write the results here")
    ns = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.chain needs a CUDA GPU (it times the chain on the device)")
    projections = projections_of(ns.model)
    chain = LayerChain(projections, ns.layers, torch.bfloat16, torch.device("cuda"))
    engine = chain.engine_choices()
    best, _, trials = pair_descent(
        [options_of(p) for p in projections], engine, chain.time_us_per_layer, ns.passes)
    # The search keeps the minimum of many noisy timings; re-time both sets, interleaved.
    confirm: dict[str, list[float]] = {"engine": [], "chain": []}
    for _ in range(ns.confirm):
        confirm["engine"].append(chain.time_us_per_layer(engine))
        confirm["chain"].append(chain.time_us_per_layer(best))
    engine_t, best_t = (statistics.median(confirm[k]) for k in ("engine", "chain"))
    for p, e, b in zip(projections, engine, best, strict=True):
        print(f"{p.name:8s} {p.n}x{p.k}: engine {e or 'unfused'}, in chain {b or 'unfused'}")
    layer_bytes = sum(p.n * p.k * 2 for p in projections)  # bf16 weights read per layer
    print(f"[chain] {ns.model}: {engine_t:.2f} us per layer with the engine's choices, "
          f"{best_t:.2f} with the chain's (medians of {ns.confirm} interleaved re-timings; "
          f"{len(trials)} chains timed in the search); weights at "
          f"{layer_bytes / engine_t / 1e6:.2f} and {layer_bytes / best_t / 1e6:.2f} TB/s "
          f"against the {COPY_CEILING_TBS} TB/s copy ceiling")
    if ns.json:
        result: dict[str, Any] = {
            "model": ns.model, "layers": ns.layers, "device": torch.cuda.get_device_name(),
            "projections": [p.__dict__ for p in projections],
            "engine": engine, "engine_us_per_layer": engine_t,
            "chain": best, "chain_us_per_layer": best_t, "confirm": confirm,
            "weight_bytes_per_layer": layer_bytes,
            "trials": [{"options": t, "us_per_layer": us} for t, us in trials],
        }
        with open(ns.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
