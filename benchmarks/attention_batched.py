"""Decode attention at many requests: tile configs per head shape, and the ragged tier's tile.

    PYTHONPATH=. python benchmarks/attention_batched.py --sweep [--json out.json]
    PYTHONPATH=. python benchmarks/attention_batched.py --ragged-tile [--json out.json]

``--sweep``: every tile config (key block 32/64/128, warps 2/4/8, stages 1/2/3) at 64 and
256 requests of 256 and 1,024 keys, for four head shapes; ``default`` marks the tile
``kernels.attention.pick_config`` takes for a decode step. ``--ragged-tile``: the same
decode batches with the tile a ``full`` graph of that many requests takes (``max_q_len``
1) and with the one a ``ragged`` graph of that token tier takes (``max_q_len`` = the tier).
Timings are CUDA-graph replays whose launches rotate over 4 block tables of disjoint random
blocks, so K/V come from HBM (``kernels.tuner.graph_time_us``).
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton

from replaylm.batch import BLOCK_SIZE
from replaylm.kernels import attention as attn
from replaylm.kernels.tuner import graph_time_us

DTYPE = torch.bfloat16


#: Head shapes of the batched decode sweep: (name, Hq, Hkv, D).
BATCHED_HEADS = (("qwen1.5-moe-a2.7b", 16, 16, 128), ("llama3.2-1b", 32, 8, 64),
                 ("qwen3-0.6b", 16, 8, 128), ("llama3-8b", 32, 8, 128))


def batched_sweep(batches: tuple[int, ...] = (64, 256), contexts: tuple[int, ...] = (256, 1024),
                  tables: int = 4) -> list[dict]:
    """Decode attention at many requests (µs per launch and K/V TB/s) per tile config.

    Every request has ``ctx`` keys; the launches of one graph rotate over ``tables`` block
    tables of disjoint random blocks, so K/V come from HBM. The grid: key block 32/64/128,
    warps 2/4/8, stages 1/2/3; ``default`` marks the config ``attention.pick_config`` takes.
    """
    rows = []
    for name, hq, hkv, d, batch, ctx, (q, k, v, cu, kv_lens, tabs) in _decode_batches(
            batches, contexts, tables):
        g_pad = attn.group_pad(hq, hkv)
        default = attn.pick_config(1, g_pad, d, attn.few_programs(q, batch, hkv))
        nbytes = 2 * batch * ctx * hkv * d * k.element_size()
        for bn, warps, stages in itertools.product((32, 64, 128), (2, 4, 8), (1, 2, 3)):
            cfg = attn.AttnConfig(block_m=max(16, g_pad), block_n=bn, num_warps=warps,
                                  num_stages=stages)
            fn = _batched_launch(q, k, v, cu, kv_lens, ctx, cfg)
            try:
                us = graph_time_us(fn, tabs, reps=2 * tables, trials=5)
            except Exception as e:  # noqa: BLE001 - e.g. out of shared memory
                rows.append(dict(heads=name, batch=batch, ctx=ctx, config=str(cfg),
                                 error=str(e)[:120]))
                continue
            rows.append(dict(heads=name, batch=batch, ctx=ctx, block_n=bn, warps=warps,
                             stages=stages, default=cfg == default, us=round(us, 2),
                             tbs=round(nbytes / us / 1e6, 3)))
    return rows


def _decode_batches(batches: tuple[int, ...], contexts: tuple[int, ...], tables: int):
    """For each of ``BATCHED_HEADS`` and each batch × context: the heads, the sizes and a
    decode batch (one query token per request, every request ``ctx`` keys) with ``tables``
    block tables of disjoint random blocks: ``(q, k_cache, v_cache, cu, kv_lens, tables)``."""
    for name, hq, hkv, d in BATCHED_HEADS:
        for batch, ctx in itertools.product(batches, contexts):
            nb = triton.cdiv(ctx, BLOCK_SIZE)
            k = torch.randn(1 + tables * batch * nb, BLOCK_SIZE, hkv, d, device="cuda",
                            dtype=DTYPE)
            perm = (torch.randperm(k.shape[0] - 1, device="cuda") + 1).to(torch.int32)
            tabs = [perm[i * batch * nb:(i + 1) * batch * nb].view(batch, nb)
                    for i in range(tables)]
            q = torch.randn(batch, hq, d, device="cuda", dtype=DTYPE)
            cu = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
            kv_lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
            yield name, hq, hkv, d, batch, ctx, (q, k, torch.randn_like(k), cu, kv_lens, tabs)


def ragged_tile_check(batches: tuple[int, ...] = (64, 256),
                      contexts: tuple[int, ...] = (256, 1024), tables: int = 4) -> list[dict]:
    """Decode-only batches (one query token per request) launched as a ``full`` graph of
    ``batch`` requests launches them (``max_q_len`` 1) and as a ``ragged`` graph of the
    ``batch``-token tier does (``max_q_len`` = the tier: any request may bring that many
    tokens, so the tile is sized for it): µs per launch of each, K/V from HBM."""
    rows = []
    for name, hq, hkv, d, batch, ctx, (q, k, v, cu, kv_lens, tabs) in _decode_batches(
            batches, contexts, tables):
        few = attn.few_programs(q, batch, hkv)
        row = dict(heads=name, batch=batch, ctx=ctx)
        for label, q_bound in (("full", 1), ("ragged", batch)):
            cfg = attn.pick_config(q_bound, attn.group_pad(hq, hkv), d, few)
            fn = _batched_launch(q, k, v, cu, kv_lens, ctx, cfg, q_bound)
            row[f"{label}_us"] = round(graph_time_us(fn, tabs, reps=2 * tables, trials=5), 2)
            row[f"{label}_config"] = str(cfg)
        rows.append(row)
    return rows


def _batched_launch(q, k, v, cu, kv_lens, ctx: int, cfg: attn.AttnConfig, max_q_len: int = 1):
    """A one-argument decode attention launch (the block table varies) for the batched
    sweep, with the engine's split count for ``ctx``."""

    def fn(table: torch.Tensor) -> None:
        attn.paged_attention(q, k, v, cu, kv_lens, table, q.shape[-1] ** -0.5,
                             max_q_len=max_q_len, max_kv_len=ctx, config=cfg)

    return fn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--sweep", action="store_true", help="every tile config per case")
    what.add_argument("--ragged-tile", action="store_true",
                      help="the full graph's tile against the ragged tier's")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "the attention benchmark needs a CUDA device"
    torch.manual_seed(0)
    if args.ragged_tile:
        rows = ragged_tile_check()
        for r in rows:
            print(f"attention {r['heads']} batch {r['batch']} ctx {r['ctx']}: full "
                  f"{r['full_us']} us, ragged tier {r['ragged_us']} us "
                  f"({r['ragged_us'] / r['full_us']:.2f}x; {r['ragged_config']})")
    else:
        rows = batched_sweep()
        for name, *_ in BATCHED_HEADS:
            for case in sorted({(r["batch"], r["ctx"]) for r in rows if r["heads"] == name}):
                got = sorted((r for r in rows if r["heads"] == name
                              and (r["batch"], r["ctx"]) == case and "us" in r),
                             key=lambda r: r["us"])
                default = next((r for r in got if r["default"]), None)
                print(f"attention {name} batch {case[0]} ctx {case[1]}: default {default}; "
                      f"best {got[:3]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
