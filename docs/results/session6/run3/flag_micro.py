"""Cost of a kernel boundary: PDL wait vs flag (arrival counter) vs plain stream order."""
import torch, triton, triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from replaylm.graphs.capture import gc_paused
dev = torch.device("cuda")
N_K = 1024

@triton.jit
def _step(x_ptr, y_ptr, cnt_in, cnt_out, cnt_old, expected, MODE: tl.constexpr, BN: tl.constexpr, W_PTR_LOAD: tl.constexpr, w_ptr):
    pid = tl.program_id(0)
    cols = tl.arange(0, 1024)
    if W_PTR_LOAD:
        w = tl.load(w_ptr + pid * 1024 * BN + tl.arange(0, BN)[:, None] * 1024 + cols[None, :])
    else:
        w = tl.full((BN, 1024), 1.0, tl.bfloat16)
    if MODE == 1:
        gdc_wait()
        gdc_launch_dependents()
    if MODE == 2:
        gdc_launch_dependents()
        c = tl.atomic_add(cnt_in, 0, sem="acquire", scope="gpu")
        while c < expected:
            c = tl.atomic_add(cnt_in, 0, sem="acquire", scope="gpu")
        if pid == 0:
            tl.atomic_xchg(cnt_old, 0, sem="relaxed", scope="gpu")
    x = tl.load(x_ptr + cols, cache_modifier=".cg").to(tl.float32)
    acc = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    tl.store(y_ptr + pid * BN + tl.arange(0, BN), (acc * 0.0009765625).to(tl.bfloat16))
    if MODE == 2:
        tl.debug_barrier()
        tl.atomic_add(cnt_out, 1, sem="release", scope="gpu")

def chain(mode, grid, n=100, wload=False):
    bn = 1024 // grid
    bufs = [torch.randn(1024, device=dev, dtype=torch.bfloat16) for _ in range(3)]
    w = torch.randn(1024 * 1024, device=dev, dtype=torch.bfloat16)
    cnt = torch.zeros(n + 3, device=dev, dtype=torch.int32)
    def body():
        cnt.zero_()
        cnt[0:1].fill_(grid)
        for i in range(n):
            kw = {"launch_pdl": True} if mode else {}
            _step[(grid,)](bufs[i % 2], bufs[(i + 1) % 2], cnt[i:], cnt[i + 1:], cnt[i - 1:] if i >= 1 else cnt[n + 2:],
                           grid, MODE=mode, BN=bn, W_PTR_LOAD=wload, w_ptr=w, num_warps=4, **kw)
    body(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with gc_paused(), torch.cuda.graph(g):
        body()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = 1e9
    for _ in range(10):
        s.record(); g.replay(); e.record(); e.synchronize()
        best = min(best, s.elapsed_time(e) * 1e3 / n)
    # correctness: compare with eager no-flag result
    return best

for wload in (False, True):
    for grid in (16, 128, 256):
        r = {m: chain(m, grid, wload=wload) for m in (0, 1, 2)}
        print(f"wload={wload} grid={grid}: plain {r[0]:.2f} us, pdl {r[1]:.2f} us, flag {r[2]:.2f} us per kernel", flush=True)
