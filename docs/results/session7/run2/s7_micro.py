"""Per-link cost of the engine's skinny projection kernel in a PDL chain (session 7)."""
import torch
from replaylm.graphs.capture import gc_paused
from replaylm.kernels import gemv
dev = torch.device("cuda")
torch.manual_seed(0)

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

def chain(mode, cfg, k=1024, copies=1, n=100):
    ws = [torch.randn(k, k, device=dev, dtype=torch.bfloat16) * 0.03 for _ in range(copies)]
    nw = torch.ones(k, device=dev, dtype=torch.bfloat16)
    x0 = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    r0 = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    def body():
        x, r = x0, r0
        for i in range(n):
            w = ws[i % copies]
            if mode == 0:
                x = gemv._launch(0, x, w, None, cfg)[0]
            elif mode == 1:
                x, r = gemv._launch(1, x, w, None, cfg, r, nw, 1e-6)
            else:  # cuBLAS
                x = torch.nn.functional.linear(x, w)
    return timed(body, n)

for copies in (1, 24):
    for cfg in [(1, 8, 1024, 4), (1, 16, 1024, 8), (1, 4, 1024, 4), (1, 2, 1024, 4), (1, 8, 512, 4), (1, 4, 512, 4)]:
        progs = 1024 // cfg[1]
        p = chain(0, cfg, copies=copies); q = chain(1, cfg, copies=copies)
        print(f"copies={copies:2d} tile={cfg} programs={progs:4d}: plain {p:.2f} us  norm {q:.2f} us", flush=True)
    print(f"copies={copies:2d} cublas {chain(2, None, copies=copies):.2f} us", flush=True)
