import sys, torch
from replaylm.kernels import prefetch, gemv
from replaylm.graphs.capture import gc_paused
dev = torch.device("cuda")
torch.manual_seed(0)
shapes = [(1024, 2048), (6144, 1024), (1024, 3072)]
sets = [[torch.randn(n, k, device=dev, dtype=torch.bfloat16) for n, k in shapes] for _ in range(6)]
x = {k: torch.randn(1, k, device=dev, dtype=torch.bfloat16) for _, k in shapes}

def timed(body, reps=6):
    body(0); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with gc_paused(), torch.cuda.graph(g):
        for i in range(reps):
            body(i)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = 1e9
    for _ in range(5):
        s.record(); g.replay(); e.record(); e.synchronize()
        best = min(best, s.elapsed_time(e) * 1e3 / reps)
    g.reset()
    return best

SLEEP = int(sys.argv[1]) if len(sys.argv) > 1 else 20000
def proj(ws):
    for w in ws:
        gemv.skinny_linear(x[w.shape[1]], w)
for lanes in (32, 128):
    for chunk in (8192, 32768, 131072):
        def pf_only(i):
            prefetch.launch(prefetch.within_budget(sets[i % 6], 1 << 40), lanes, chunk)
        print(f"prefetch alone lanes={lanes} chunk={chunk}: {timed(pf_only):.2f} us per 23MB", flush=True)
def sleep_only(i):
    torch.cuda._sleep(SLEEP)
def cold(i):
    torch.cuda._sleep(SLEEP); proj(sets[i % 6])
def pf(i):
    p = prefetch.within_budget(sets[i % 6], 1 << 40)
    prefetch.start(p, dev)
    torch.cuda._sleep(SLEEP); proj(sets[i % 6])
    prefetch.join(dev)
def proj_only(i):
    proj(sets[i % 6])
def proj_warm(i):
    proj(sets[0])
t0 = timed(sleep_only); t1 = timed(cold); t2 = timed(pf); t3 = timed(proj_only); t4 = timed(proj_warm)
print(f"sleep {t0:.2f}; sleep+proj cold {t1:.2f} (+{t1-t0:.2f}); with side prefetch {t2:.2f} (+{t2-t0:.2f}); proj only cold {t3:.2f}; proj L2-warm {t4:.2f}")
