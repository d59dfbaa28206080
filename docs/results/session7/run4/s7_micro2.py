"""Per-link cost of each real 0.6B projection shape, repeated 60x in a PDL chain, weights
from HBM (copies > 2x L2), for several tiles (session 7). Env REPLAYLM_GEMV_PIN toggles."""
import os, torch, triton
from replaylm.graphs.capture import gc_paused
from replaylm.kernels import gemv
from replaylm.bench.ptxas import programs_per_sm
dev = torch.device("cuda")
torch.manual_seed(0)
L2 = torch.cuda.get_device_properties(dev).L2_cache_size

def timed(body, n):
    body(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with gc_paused(), torch.cuda.graph(g):
        body()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = 1e9
    for _ in range(10):
        s.record(); g.replay(); e.record(); e.synchronize()
        best = min(best, s.elapsed_time(e) * 1e3 / n)
    g.reset()
    return best

shapes = [("qkv", 1, 4096, 1024), ("o", 0, 1024, 2048), ("gate_up", 1, 6144, 1024), ("down", 2, 1024, 3072)]
tiles = [(4,1024,4),(8,512,4),(4,2048,8),(8,1024,8),(16,512,8),(16,1024,8),(8,1024,4),(16,1024,4),(4,512,4),(2,1024,4)]
N = 60
for name, pro, n, k in shapes:
    copies = max(2, -(-3 * L2 // (n * k * 2)))
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.03 for _ in range(copies)]
    nw = torch.ones(k, device=dev, dtype=torch.bfloat16)
    xin = torch.randn(1, 2 * k if pro == 2 else k, device=dev, dtype=torch.bfloat16)
    r0 = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    big = torch.zeros(1, max(n, 2 * k), device=dev, dtype=torch.bfloat16)
    res = []
    for bn, bk, w in tiles:
        bk = min(bk, triton.next_power_of_2(k))
        if triton.cdiv(k, bk) > 4: continue
        cfg = (1, bn, bk, w)
        def body():
            x, r = xin, r0
            for i in range(N):
                wt = ws[i % copies]
                if pro == 1:
                    y, r = gemv._launch(1, x, wt, None, cfg, r, nw, 1e-6)
                else:
                    y = gemv._launch(pro, x, wt, None, cfg)[0]
                # each launch waits for the previous one (PDL) whatever it reads
        us = timed(body, N)
        res.append((us, cfg))
        print(f"{name:7s} {n}x{k} tile {bn:2d}x{bk:4d} w{w} progs {n//bn:5d}: {us:5.2f} us/link  {n*k*2/us/1e6:.2f} TB/s", flush=True)
    print(f"{name} best {min(res)}", flush=True)
