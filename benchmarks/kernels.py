"""Attention kernel benchmark: decode bandwidth vs the HBM ceiling, prefill TFLOP/s vs SDPA.

    PYTHONPATH=. python benchmarks/kernels.py [--json out.json] [--sweep | --latency]

Decode: batch {1, 8, 64} x context {512, 4096, 32768}, Llama-3-8B heads (Hq=32, Hkv=8,
D=128, bf16), one new token per request over a randomly paged cache. Reported as K/V bytes
read per second against the H200 copy ceiling (4.23 TB/s) and a measured device copy.
Prefill: one 2048-token causal chunk with the same heads, in TFLOP/s, against torch SDPA's
flash backend on the same contiguous shape (K/V expanded to 32 heads).
Timings are CUDA-graph replays (``triton.testing.do_bench_cudagraph``), so they measure the
GPU, not Python launch overhead — which is how the engine runs these kernels.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

from replaylm.batch import BLOCK_SIZE
from replaylm.kernels import attention as attn
from replaylm.kernels.tuner import graph_time_us

COPY_CEILING_TBS = 4.23  # H200 device-to-device copy bandwidth
HQ, HKV, D = 32, 8, 128
DTYPE = torch.bfloat16


def _time_ms(fn) -> float:
    fn()  # compile (and surface resource errors) outside any graph capture
    torch.cuda.synchronize()
    try:
        return do_bench_cudagraph(fn, rep=100)
    except Exception:  # noqa: BLE001 - fall back to stream timing if capture is refused
        return do_bench(fn, rep=100)


def measured_copy_tbs() -> float:
    """Achieved device copy bandwidth (read + write bytes) on a 2 GiB buffer."""
    src = torch.empty(1 << 30, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), rep=100)
    return 2 * src.numel() * 2 / (ms * 1e-3) / 1e12


class PagedPool:
    """One big KV pool; each case takes a random subset of blocks (block 0 is scratch)."""

    def __init__(self, max_tokens: int) -> None:
        self.num_blocks = 1 + triton.cdiv(max_tokens, BLOCK_SIZE)
        self.k = torch.randn(self.num_blocks, BLOCK_SIZE, HKV, D, device="cuda", dtype=DTYPE)
        self.v = torch.randn_like(self.k)

    def block_table(self, batch: int, ctx: int) -> torch.Tensor:
        nb = triton.cdiv(ctx, BLOCK_SIZE)
        ids = torch.randperm(self.num_blocks - 1, device="cuda")[: batch * nb] + 1
        return ids.view(batch, nb).to(torch.int32)


def bench_decode(pool: PagedPool, batch: int, ctx: int, **kw) -> dict:
    q = torch.randn(batch, HQ, D, device="cuda", dtype=DTYPE)
    cu = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    kv_lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    bt = pool.block_table(batch, ctx)

    def fn():
        attn.paged_attention(q, pool.k, pool.v, cu, kv_lens, bt, D**-0.5, max_q_len=1,
                             max_kv_len=ctx, **kw)

    ms = _time_ms(fn)
    nbytes = 2 * batch * ctx * HKV * D * q.element_size()
    tbs = nbytes / (ms * 1e-3) / 1e12
    cfg = kw.get("config") or attn.pick_config(1, attn.group_pad(HQ, HKV), D,
                                               attn.few_programs(q, batch, HKV))
    splits = kw.get("num_splits") or attn.pick_num_splits(
        q, batch, HKV, 1, ctx, cfg.block_n, kw.get("min_split_keys") or cfg.min_split_keys)
    return {"batch": batch, "context": ctx, "us": ms * 1e3, "TB/s": tbs,
            "pct_of_ceiling": 100 * tbs / COPY_CEILING_TBS, "num_splits": splits,
            **({"config": str(kw["config"])} if kw.get("config") else {})}


def _prefill_flops(n: int) -> float:
    return 4.0 * HQ * D * n * (n + 1) / 2  # QK^T and PV over the causal triangle


def bench_prefill(pool: PagedPool, n: int = 2048, **kw) -> dict:
    q = torch.randn(n, HQ, D, device="cuda", dtype=DTYPE)
    cu = torch.tensor([0, n], device="cuda", dtype=torch.int32)
    kv_lens = torch.tensor([n], device="cuda", dtype=torch.int32)
    bt = pool.block_table(1, n)

    def fn():
        attn.paged_attention(q, pool.k, pool.v, cu, kv_lens, bt, D**-0.5, max_q_len=n,
                             max_kv_len=n, **kw)

    ms = _time_ms(fn)
    res = {"tokens": n, "us": ms * 1e3, "TFLOP/s": _prefill_flops(n) / (ms * 1e-3) / 1e12}
    if kw.get("config"):
        res["config"] = str(kw["config"])
    return res


def bench_sdpa(n: int = 2048) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, HQ, n, D, device="cuda", dtype=DTYPE)
    k = torch.randn(1, HQ, n, D, device="cuda", dtype=DTYPE)
    v = torch.randn_like(k)

    def fn():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    ms = _time_ms(fn)
    return {"tokens": n, "us": ms * 1e3, "TFLOP/s": _prefill_flops(n) / (ms * 1e-3) / 1e12}


def sweep(pool: PagedPool) -> dict:
    """A small grid of tile configs for the two headline cases, to guide the defaults."""
    out: dict[str, list] = {"decode_b64_c4096": [], "decode_b1_c32768": [], "prefill": []}
    for bn in (32, 64, 128):
        for warps in (4, 8):
            for stages in (2, 3, 4):
                cfg = attn.AttnConfig(16, bn, warps, stages)
                out["decode_b64_c4096"].append(bench_decode(pool, 64, 4096, config=cfg))
                if warps == 4 and stages == 3:
                    for splits in (16, 32):
                        out["decode_b1_c32768"].append(
                            bench_decode(pool, 1, 32768, config=cfg, num_splits=splits))
    for bm in (64, 128):
        for bn in (64, 128):
            for warps in (4, 8):
                for stages in (2, 3):
                    cfg = attn.AttnConfig(bm, bn, warps, stages)
                    try:
                        out["prefill"].append(bench_prefill(pool, config=cfg))
                    except Exception as e:  # noqa: BLE001 - e.g. out of shared memory
                        out["prefill"].append({"config": str(cfg), "error": str(e)[:200]})
    return out


#: Head shapes of the batch-1 latency sweep: (name, Hq, Hkv, D).
LATENCY_HEADS = (("qwen3-0.6b", 16, 8, 128), ("llama3.2-1b", 32, 8, 64))


def latency_sweep(calls: int = 100, contexts: tuple[int, ...] = (64, 160, 288)) -> list[dict]:
    """Batch-1 decode attention latency per tile config (µs per launch).

    One CUDA graph holds ``calls`` launches, each over its own random blocks, so K/V come
    from HBM as in a decode step (one layer's cache is read once per step) rather than from
    L2; PDL chains the launches as in the engine. The grid: key block 32/64/128, warps
    2/4/8, split minimum 64/128/256 keys, 1/2 stages, 16 splits (the decode tiers' grid).
    The batch-1 latency tile of ``replaylm.kernels.attention`` was picked from this sweep.
    """
    rows = []
    for name, hq, hkv, d in LATENCY_HEADS:
        nb = triton.cdiv(max(contexts) + BLOCK_SIZE, BLOCK_SIZE)
        pool_blocks = 1 + calls * nb
        k = torch.randn(pool_blocks, BLOCK_SIZE, hkv, d, device="cuda", dtype=DTYPE)
        v = torch.randn_like(k)
        perm = (torch.randperm(pool_blocks - 1, device="cuda") + 1).to(torch.int32)
        tables = [perm[i * nb:(i + 1) * nb].view(1, nb) for i in range(calls)]
        q = torch.randn(1, hq, d, device="cuda", dtype=DTYPE)
        cu = torch.tensor([0, 1], device="cuda", dtype=torch.int32)
        for ctx in contexts:
            kv_lens = torch.tensor([ctx], device="cuda", dtype=torch.int32)
            for bn, warps, min_split, stages in itertools.product(
                    (32, 64, 128), (2, 4, 8), (64, 128, 256), (1, 2)):
                if min_split < bn:
                    continue
                cfg = attn.AttnConfig(block_m=16, block_n=bn, num_warps=warps,
                                      num_stages=stages)
                fn = _decode_launch(q, k, v, cu, kv_lens, cfg, min_split)
                rows.append(dict(heads=name, ctx=ctx, block_n=bn, warps=warps,
                                 min_split=min_split, stages=stages,
                                 us=round(graph_time_us(fn, tables, reps=len(tables), trials=5), 2)))
    return rows


def rotary_latency_sweep(calls: int = 100) -> list[dict]:
    """Batch-1 rotary launch latency (q/k norm where the model has it, rotary, KV write) per
    launch shape: heads per program 1/2/4/8 × warps 1/2/4, ``calls`` launches per graph,
    each writing its own cache slot."""
    from replaylm.kernels import elementwise

    rows = []
    for name, hq, hkv, d in LATENCY_HEADS:
        qkv = torch.randn(1, (hq + 2 * hkv) * d, device="cuda", dtype=DTYPE)
        q = qkv[:, :hq * d].view(1, hq, d)
        k = qkv[:, hq * d:(hq + hkv) * d].view(1, hkv, d)
        v = qkv[:, (hq + hkv) * d:].view(1, hkv, d)
        caches = [torch.zeros(triton.cdiv(calls, BLOCK_SIZE), BLOCK_SIZE, hkv, d, device="cuda",
                              dtype=DTYPE) for _ in range(2)]
        inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, device="cuda").float() / d))
        freqs = torch.outer(torch.arange(4096, device="cuda").float(), inv)
        norms = {}
        if name.startswith("qwen3"):
            norms = dict(q_norm_weight=torch.ones(d, device="cuda", dtype=DTYPE),
                         k_norm_weight=torch.ones(d, device="cuda", dtype=DTYPE))
        args = dict(positions=torch.tensor([300], device="cuda"),
                    cos_sin=torch.cat([freqs.cos(), freqs.sin()], -1), v=v,
                    k_cache=caches[0], v_cache=caches[1], **norms)
        slots = [torch.tensor([i], device="cuda") for i in range(calls)]
        for hp, warps in itertools.product((1, 2, 4, 8), (1, 2, 4)):
            fn = _rotary_launch(elementwise.rotary, q, k, args, hp, warps)
            rows.append(dict(heads=name, heads_per_program=hp, warps=warps,
                             us=round(graph_time_us(fn, slots, reps=len(slots), trials=5), 2)))
    return rows


def _rotary_launch(rotary, q, k, args: dict, hp: int, warps: int):
    """A one-argument rotary launch (the cache slot varies) for the sweep."""

    def fn(slot: torch.Tensor) -> None:
        rotary(q, k, args["positions"], args["cos_sin"], slot_mapping=slot,
               heads_per_program=hp, num_warps=warps,
               **{n: t for n, t in args.items() if n not in ("positions", "cos_sin")})

    return fn


def _decode_launch(q, k, v, cu, kv_lens, cfg: attn.AttnConfig, min_split: int):
    """A one-argument decode attention launch (the block table varies) for the sweep."""
    scale = q.shape[-1] ** -0.5

    def fn(table: torch.Tensor) -> None:
        attn.paged_attention(q, k, v, cu, kv_lens, table, scale, max_q_len=1, max_kv_len=4096,
                             num_splits=16, min_split_keys=min_split, config=cfg)

    return fn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--sweep", action="store_true", help="also sweep tile configs")
    ap.add_argument("--latency", action="store_true",
                    help="only the batch-1 latency sweeps: attention and rotary launch shapes")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "the kernel benchmark needs a CUDA device"
    torch.manual_seed(0)
    if args.latency:
        rows = latency_sweep()
        rotary_rows = rotary_latency_sweep()
        for name, *_ in LATENCY_HEADS:
            for ctx in sorted({r["ctx"] for r in rows}):
                case = sorted((r for r in rows if r["heads"] == name and r["ctx"] == ctx),
                              key=lambda r: r["us"])
                print(f"attention {name} ctx {ctx}: best {case[:3]}")
            case = sorted((r for r in rotary_rows if r["heads"] == name), key=lambda r: r["us"])
            print(f"rotary {name}: best {case[:3]}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"attention": rows, "rotary": rotary_rows}, f, indent=1)
        return
    pool = PagedPool(64 * 32768)
    copy = measured_copy_tbs()
    print(f"device: {torch.cuda.get_device_name()}  measured copy {copy:.2f} TB/s, "
          f"ceiling used {COPY_CEILING_TBS} TB/s")
    results: dict = {"device": torch.cuda.get_device_name(), "copy_TB/s": copy,
                     "ceiling_TB/s": COPY_CEILING_TBS, "decode": [], "prefill": {}}
    print(f"decode (Hq={HQ} Hkv={HKV} D={D} bf16): K/V bytes / time")
    for batch in (1, 8, 64):
        for ctx in (512, 4096, 32768):
            r = bench_decode(pool, batch, ctx)
            results["decode"].append(r)
            print(f"  batch {batch:3d} ctx {ctx:6d}: {r['us']:9.1f} us  {r['TB/s']:5.2f} TB/s "
                  f"({r['pct_of_ceiling']:5.1f}% of {COPY_CEILING_TBS})  splits={r['num_splits']}")
    ours, ref = bench_prefill(pool), bench_sdpa()
    ratio = ref["TFLOP/s"] / ours["TFLOP/s"]
    results["prefill"] = {"triton": ours, "sdpa_flash": ref, "sdpa_over_triton": ratio}
    print(f"prefill 2048 causal: triton {ours['TFLOP/s']:.0f} TFLOP/s ({ours['us']:.0f} us), "
          f"SDPA flash {ref['TFLOP/s']:.0f} TFLOP/s ({ref['us']:.0f} us): SDPA/triton = "
          f"{ratio:.2f}x (target <= 1.5x)")
    if args.sweep:
        results["sweep"] = sweep(pool)
        for name, rows in results["sweep"].items():
            key = "TFLOP/s" if name == "prefill" else "TB/s"
            best = max((r for r in rows if key in r), key=lambda r: r[key], default=None)
            print(f"sweep {name}: best {best}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
