"""FP8-weight benchmark: per-GEMV bandwidth of the decode projections, the many-row paths, and
the numerics against bf16.

``gemv``: each projection of the named shapes at ``--m`` rows, bf16 weights (cuBLAS, the
skinny tile the tuner keeps) against FP8 weights (the FP8 skinny tile the tuner keeps,
W8A8 ``torch._scaled_mm``, dequantize + cuBLAS), as µs and achieved bandwidth over the
bytes each reads (FP8: one per weight plus four per row for the scales), and the share of
the bound: bytes ÷ 4.23 TB/s, the H200's measured copy bandwidth. The kept tile is
``tuner.pick_tile``'s among all candidates (``*_config``; five entries: split-K), beside
the best whole-K tile (``*_whole_k``); a closing table lists them per projection. Every kernel is captured 50 times in one CUDA graph and
replayed, over weight copies larger than L2 together (``tuner.graph_time_us``), as the
tuner times them.

``rows``: bf16 cuBLAS, W8A8 and dequantize + cuBLAS at 16-512 rows (what the rule of
``kernels.fp8_linear`` picks between above the skinny kernel).

``numerics``: per projection, the relative error of the FP8 output against the bf16 one
(random weights as ``load_format="dummy"`` draws them, ``randn`` inputs), at 1 row (the
skinny kernel) and 64 rows (W8A8); and the cosine similarity of a whole model's logits
(dummy weights of the named shape, bf16 against ``quantization="fp8"``, a 32-token prompt's
positions, the torch reference ops), beside the same bf16 weights upcast to fp32 against
bf16 (what bf16 itself costs); ``--layers 1,2,4`` adds the first 1, 2 and 4 layers alone, to
show how the error grows with depth.

    PYTHONPATH=. python benchmarks/fp8.py gemv --shapes llama3-8b --m 1 [--json OUT]
    PYTHONPATH=. python benchmarks/fp8.py rows --shapes llama3.2-1b
    PYTHONPATH=. python benchmarks/fp8.py numerics --shapes llama3.2-1b --layers 1,2,4,8
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json

import torch

from replaylm.batch import BLOCK_SIZE, AttentionMetadata
from replaylm.bench.floor import COPY_BANDWIDTH_BYTES_S
from replaylm.kernels import fp8_linear, ops, ref, skinny
from replaylm.kernels.tuner import candidates, graph_time_us, pick_tile, weight_rotation
from replaylm.model.config import ModelConfig
from replaylm.model.shapes import NAMED_SHAPES, hf_config_from_dict

REPS = 50
BF16 = torch.bfloat16


def config(shape: str) -> ModelConfig:
    return ModelConfig.from_hf(hf_config_from_dict(NAMED_SHAPES[shape]), shape)


def projections(shape: str) -> list[tuple[str, int, int]]:
    cfg = config(shape)
    h = cfg.hidden_size
    return [("qkv", cfg.q_size + 2 * cfg.kv_size, h), ("o", h, cfg.q_size),
            ("gate_up", 2 * cfg.intermediate_size, h), ("down", h, cfg.intermediate_size),
            ("lm_head", cfg.vocab_size, h)]


def time_us(fn, weights) -> float:
    return graph_time_us(fn, weights, reps=REPS, trials=5)


def _weights(n: int, k: int, dev: str = "cuda") -> torch.Tensor:
    return torch.empty(n, k, device=dev, dtype=BF16).uniform_(-0.0346, 0.0346)


def _skinny_times(x: torch.Tensor, weights: list, scale: torch.Tensor | None,
                  ) -> dict[tuple, float]:
    """µs of every skinny tile the tuner times at this shape (split-K tiles included)."""
    dtype = weights[0].dtype if scale is not None else None
    return {cfg: time_us(lambda w, cfg=cfg: skinny.skinny_linear(x, w, config=cfg,
                                                                 scale=scale), weights)
            for cfg in candidates(x.shape[0], x.shape[1], dtype)}


def _put_skinny(put, label: str, times: dict[tuple, float], nbytes: int) -> None:
    """The tile the tuner keeps (``tuner.pick_tile``: its tie rule) as ``label``, and the
    best whole-K tile (no split-K) as ``label_whole_k``."""
    cfg, us = pick_tile(list(times.items()))
    put(label, us, nbytes, cfg)
    whole = {c: t for c, t in times.items() if len(c) == 4}
    best = min(whole, key=whole.get)
    put(f"{label}_whole_k", whole[best], nbytes, best)


def gemv(ns: argparse.Namespace) -> list[dict]:
    rows = []
    for shape in ns.shapes.split(","):
        for (name, n, k) in projections(shape):
            w = _weights(n, k)
            q, scale = ref.quantize_fp8(w)
            bf16_bytes, fp8_bytes = w.numel() * 2, q.numel() + scale.numel() * 4
            ws, qs = weight_rotation(w), weight_rotation(q)
            for m in (int(v) for v in ns.m.split(",")):
                x = torch.randn(m, k, device="cuda", dtype=BF16)
                row = {"shape": shape, "proj": name, "m": m, "n": n, "k": k}

                def put(label, us, nbytes, cfg=None, row=row):
                    row[f"{label}_us"] = round(us, 2)
                    row[f"{label}_tbs"] = round(nbytes / us / 1e6, 3)
                    row[f"{label}_bound_share"] = round(
                        nbytes / COPY_BANDWIDTH_BYTES_S * 1e6 / us, 3)
                    if cfg is not None:
                        row[f"{label}_config"] = list(cfg)

                put("bf16_cublas", time_us(lambda w, x=x: torch.nn.functional.linear(x, w),
                                           ws), bf16_bytes)
                _put_skinny(put, "bf16_skinny", _skinny_times(x, ws, None), bf16_bytes)
                _put_skinny(put, "fp8_skinny", _skinny_times(x, qs, scale), fp8_bytes)
                if fp8_linear.w8a8_applies(x, q):
                    put("fp8_w8a8", time_us(lambda w, x=x, s=scale: fp8_linear.w8a8_linear(
                        x, w, s), qs), fp8_bytes)
                put("fp8_dequant", time_us(lambda w, x=x, s=scale: ref.linear(x, w, scale=s), qs),
                    fp8_bytes)
                print(json.dumps(row), flush=True)
                rows.append(row)
            del ws, qs
            gc.collect()
            torch.cuda.empty_cache()
    _summary(rows)
    return rows


def _summary(rows: list[dict]) -> None:
    """Per projection: the FP8 tile the tuner keeps (split-K when it has five entries), its
    share of the bound, and the best whole-K tile's share."""
    print(f"{'shape':<12} {'proj':<8} {'m':>2}  {'fp8 chosen tile':<24} {'us':>7} "
          f"{'share':>6}  {'whole-K tile':<20} {'share':>6}")
    for r in rows:
        print(f"{r['shape']:<12} {r['proj']:<8} {r['m']:>2}  {str(r['fp8_skinny_config']):<24} "
              f"{r['fp8_skinny_us']:>7.2f} {r['fp8_skinny_bound_share']:>6.3f}  "
              f"{str(r['fp8_skinny_whole_k_config']):<20} "
              f"{r['fp8_skinny_whole_k_bound_share']:>6.3f}")


def many_rows(ns: argparse.Namespace) -> list[dict]:
    rows = []
    for shape in ns.shapes.split(","):
        for (name, n, k) in projections(shape)[:4]:
            w = _weights(n, k)
            q, scale = ref.quantize_fp8(w)
            ws, qs = weight_rotation(w), weight_rotation(q)
            for m in (16, 32, 64, 128, 256, 512):
                x = torch.randn(m, k, device="cuda", dtype=BF16)
                row = {"shape": shape, "proj": name, "m": m, "n": n, "k": k,
                       "bf16_us": round(time_us(
                           lambda w, x=x: torch.nn.functional.linear(x, w), ws), 2),
                       "w8a8_us": round(time_us(
                           lambda w, x=x, s=scale: fp8_linear.w8a8_linear(x, w, s), qs), 2),
                       "dequant_us": round(time_us(
                           lambda w, x=x, s=scale: ref.linear(x, w, scale=s), qs), 2)}
                print(json.dumps(row), flush=True)
                rows.append(row)
            del ws, qs
            gc.collect()
            torch.cuda.empty_cache()
    return rows


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _prefill_meta(n: int, dev: str) -> AttentionMetadata:
    """One request's ``n``-token prefill over KV blocks 1 and 2."""
    table = torch.tensor([[1, 2]], dtype=torch.int32, device=dev)
    pos = torch.arange(n, device=dev)
    return AttentionMetadata(
        cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=dev),
        kv_lens=torch.tensor([n], dtype=torch.int32, device=dev), block_table=table,
        slot_mapping=table[0, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE,
        num_tokens=n, num_reqs=1, max_q_len=n, max_kv_len=n, cu_seqlens_q_cpu=[0, n],
        kv_lens_cpu=[n])


def _logits(cfg: ModelConfig, ids: torch.Tensor, dev: str, fp8, upcast: bool,
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The final hidden states and logits (fp32) of a prefill of ``ids`` through dummy weights
    of shape ``cfg`` (the same draw every call): bf16, FP8 (``fp8``), or the bf16 weights
    upcast to fp32 (``upcast``)."""
    from replaylm.attention.torch_ref import TorchAttentionBackend
    from replaylm.model.loader import load_model

    model = load_model(cfg, None, "dummy", BF16, torch.device(dev), 0, fp8=fp8)
    dtype = torch.float32 if upcast else BF16
    model = model.to(dtype)
    pool = torch.zeros(cfg.num_layers, 2, 4, 16, cfg.num_kv_heads, cfg.head_dim, device=dev,
                       dtype=dtype)
    model.bind(TorchAttentionBackend(), [(pool[i, 0], pool[i, 1])
                                         for i in range(cfg.num_layers)], 64)
    with torch.inference_mode():
        hidden = model(ids, torch.arange(len(ids), device=dev), _prefill_meta(len(ids), dev))
        logits = model.compute_logits(hidden).float()
        hidden = hidden.float()
    del model, pool
    gc.collect()
    if dev == "cuda":
        torch.cuda.empty_cache()
    return hidden, logits


def numerics(ns: argparse.Namespace) -> list[dict]:
    from replaylm.model.quant import Fp8Scheme

    dev = ns.device
    rows = []
    for shape in ns.shapes.split(","):
        for (name, n, k) in projections(shape):
            w = _weights(n, k, dev)
            q, scale = ref.quantize_fp8(w)
            row = {"shape": shape, "proj": name}
            for m in (1, 64):
                x = torch.randn(m, k, device=dev, dtype=BF16)
                want = torch.nn.functional.linear(x, w)
                got = ops.linear(x, q, scale=scale)  # the engine's path at m rows
                row[f"rel_err_m{m}"] = round(_rel(got, want), 4)
            print(json.dumps(row), flush=True)
            rows.append(row)
            del w, q
        base = config(shape)
        ids = torch.randint(3, base.vocab_size, (32,), device=dev,
                            generator=torch.Generator(device=dev).manual_seed(0))
        depths = sorted({int(v) for v in ns.layers.split(",")} | {base.num_layers}
                        ) if ns.layers else [base.num_layers]
        for layers in (d for d in depths if d <= base.num_layers):
            cfg = dataclasses.replace(base, num_layers=layers)
            (h16, bf16), (h8, fp8), (_, fp32) = (
                _logits(cfg, ids, dev, fp8, up)
                for fp8, up in ((None, False), (Fp8Scheme(), False), (None, True)))
            cos = torch.nn.functional.cosine_similarity(bf16, fp8, dim=-1)
            ref_cos = torch.nn.functional.cosine_similarity(fp32, bf16, dim=-1)
            row = {"shape": shape, "layers": layers, "hidden_rel_err": round(_rel(h8, h16), 4),
                   "logits_cosine_min": round(cos.min().item(), 5),
                   "logits_cosine_mean": round(cos.mean().item(), 5),
                   "argmax_agree": round((bf16.argmax(-1) == fp8.argmax(-1))
                                         .float().mean().item(), 3),
                   "bf16_vs_fp32_cosine_min": round(ref_cos.min().item(), 5)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["gemv", "rows", "numerics"])
    ap.add_argument("--shapes", default="llama3-8b")
    ap.add_argument("--m", default="1", help="gemv: row counts (comma-separated)")
    ap.add_argument("--device", default="cuda", help="numerics: where to run (cpu works)")
    ap.add_argument("--layers", default="",
                    help="numerics: also the logits of the first N layers alone, N in this "
                         "comma-separated list (the model's depth is always included)")
    ap.add_argument("--json", default=None)
    ns = ap.parse_args(argv)
    rows = {"gemv": gemv, "rows": many_rows, "numerics": numerics}[ns.what](ns)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
