"""Session 9: LM head at batch 1, cuBLAS against the skinny kernel's tiles, and argmax."""
import torch
from replaylm.kernels import gemv
from replaylm.kernels.argmax import argmax

torch.manual_seed(0)
for n, k in ((151936, 1024), (128256, 2048)):
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    ws = gemv.weight_rotation(w)
    out = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
    cub = gemv.graph_time_us(lambda w: torch.mm(x, w.t(), out=out), ws)
    gb = n * k * 2 / 1e9
    print(f"== LM head {n}x{k} ({gb:.3f} GB), copies {len(ws)}: cuBLAS {cub:.2f} us ({gb / cub * 1e6 / 1e3:.2f} TB/s)")
    am = gemv.graph_time_us(lambda w: argmax(out), ws)
    both = gemv.graph_time_us(lambda w: argmax(torch.mm(x, w.t(), out=out)), ws)
    print(f"   argmax alone {am:.2f} us; cuBLAS + argmax {both:.2f} us")
    cfgs = gemv.candidate_configs(1, k) + [(1, 8, 1024, 8), (1, 16, 1024, 8), (1, 16, 512, 8),
                                           (1, 32, 512, 8), (1, 32, 256, 8), (1, 16, 1024, 16)]
    for cfg in cfgs:
        try:
            us = gemv.graph_time_us(lambda w, cfg=cfg: gemv.skinny_linear(x, w, config=cfg), ws)
        except Exception as e:  # noqa: BLE001
            print(f"   {cfg}: {type(e).__name__} {str(e)[:80]}")
            continue
        y = gemv.skinny_linear(x, w, config=cfg)
        err = (y.float() - torch.mm(x, w.t()).float()).abs().max().item()
        print(f"   skinny {cfg}: {us:.2f} us ({gb / us * 1e6 / 1e3:.2f} TB/s), max err {err:.3g}")
    del w, ws
    torch.cuda.empty_cache()
