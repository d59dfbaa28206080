"""All-reduce on decode-sized messages: NCCL against torch's symmetric-memory one-shot and
two-shot ops, each timed inside a CUDA graph, and what the engine's ``all_reduce_backend=auto``
picks on this machine.

One process per GPU (torch.multiprocessing). For each hidden size and token count the message
is ``tokens × hidden`` elements of ``--dtype``. Each algorithm is first checked against NCCL's
sum of the same random tensors, eagerly and replayed from a captured graph, for a fresh tensor
and for one that starts inside a larger allocation; then ``--calls`` calls are captured in one graph and replayed, best of
``--trials``, the ranks' largest time counting (``replaylm.model.allreduce.graph_latency_us``:
launch overhead is out, as inside a decode graph). The ``engine`` column is the algorithm the
engine's plan (``AllReducer.configure('auto')``, measured at its own buckets) gives that
message. Rank 0 prints the table; ``--json`` writes every row and the engine's report.

    PYTHONPATH=. python benchmarks/allreduce.py --gpus 2 --hidden 4096 --json allreduce.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from replaylm.model.allreduce import (  # noqa: E402
    NCCL,
    ONE_SHOT,
    TWO_SHOT,
    TWO_SHOT_WORLD_SIZES,
    AllReducer,
    graph_latency_us,
    symm_all_reduce,
    symm_mem_unavailable,
)

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def _int_list(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=2, help="ranks, one GPU each")
    ap.add_argument("--hidden", type=_int_list, default=[4096], help="hidden sizes, a,b,...")
    ap.add_argument("--tokens", type=_int_list, default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512],
                    help="rows per message, a,b,...")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    ap.add_argument("--calls", type=int, default=20, help="all-reduces per timed graph")
    ap.add_argument("--trials", type=int, default=5, help="timed replays (the best counts)")
    ap.add_argument("--timeout-s", type=float, default=300.0, help="collective timeout")
    ap.add_argument("--json", default=None, help="write the rows and reports here")
    ns = ap.parse_args(argv)
    if ns.gpus < 2:
        ap.error("--gpus must be at least 2 (an all-reduce needs peers)")
    return ns


def run(ns: argparse.Namespace) -> dict:
    """Start ``ns.gpus`` ranks, run the benchmark, return rank 0's record."""
    if torch.cuda.device_count() < ns.gpus:
        raise SystemExit(f"needs {ns.gpus} CUDA devices, found {torch.cuda.device_count()}")
    with tempfile.TemporaryDirectory(prefix="replaylm-allreduce-") as tmp:
        out = Path(tmp) / "record.json"
        mp.spawn(_rank_main, args=(ns, str(Path(tmp) / "rendezvous"), str(out)),
                 nprocs=ns.gpus, join=True)
        return json.loads(out.read_text())


def _rank_main(rank: int, ns: argparse.Namespace, init_file: str, out: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"file://{init_file}",
                            rank=rank, world_size=ns.gpus,
                            timeout=timedelta(seconds=ns.timeout_s))
    try:
        record = _benchmark(ns)
        if rank == 0:
            Path(out).write_text(json.dumps(record))
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()


def _benchmark(ns: argparse.Namespace) -> dict:
    device = torch.device("cuda", torch.cuda.current_device())
    dtype = DTYPES[ns.dtype]
    group = dist.new_group(list(range(ns.gpus)))  # a subgroup, as the engine's TP group
    dist.all_reduce(torch.zeros(1, device=device), group=group)  # NCCL communicator now
    why = symm_mem_unavailable(device, dtype)
    algos = [NCCL] + ([] if why else [ONE_SHOT] + ([TWO_SHOT] if ns.gpus in
                                                     TWO_SHOT_WORLD_SIZES else []))
    record = {"gpus": ns.gpus, "device": torch.cuda.get_device_name(device),
              "torch": torch.__version__, "dtype": ns.dtype, "calls": ns.calls,
              "trials": ns.trials, "symm_mem_unavailable": why, "rows": [], "engine": {}}
    for hidden in ns.hidden:
        reducer = AllReducer()
        record["engine"][str(hidden)] = reducer.configure("auto", group, hidden, dtype, device)
        record["rows"] += _rows(ns, hidden, algos, reducer, group)
    return record


def _rows(ns: argparse.Namespace, hidden: int, algos: list[str], reducer: AllReducer,
          group: dist.ProcessGroup) -> list[dict]:
    """One row per token count at ``hidden``: each algorithm checked and timed."""
    device = torch.device("cuda", torch.cuda.current_device())
    dtype = DTYPES[ns.dtype]
    buffer = None
    if len(algos) > 1:
        import torch.distributed._symmetric_memory as symm_mem

        buffer = symm_mem.empty(hidden * max(ns.tokens), dtype=dtype, device=device)
        symm_mem.rendezvous(buffer, group.group_name)
    rows = []
    for tokens in ns.tokens:
        x = torch.zeros(tokens, hidden, dtype=dtype, device=device)
        row = {"hidden": hidden, "tokens": tokens, "bytes": x.numel() * x.element_size(),
               "engine": reducer.algorithm(x)}
        for algo in algos:
            if algo != NCCL:
                row[f"{algo}_max_diff"] = _check(algo, x.numel(), buffer, group)
            row[f"{algo}_us"] = graph_latency_us(_caller(algo, x, buffer, group), ns.calls,
                                                 ns.trials)
        times = torch.tensor([row[f"{a}_us"] for a in algos], dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)  # CPU: gloo
        for a, t in zip(algos, times.tolist()):
            row[f"{a}_us"] = round(t, 2)
        row["fastest"] = min(algos, key=lambda a: row[f"{a}_us"])
        rows.append(row)
    return rows


def _caller(algo: str, x: torch.Tensor, buffer: torch.Tensor | None,
            group: dist.ProcessGroup) -> Callable[[], None]:
    if algo == NCCL:
        return lambda: dist.all_reduce(x, group=group)
    return lambda: symm_all_reduce(x, buffer, group.group_name, algo)


def _check(algo: str, numel: int, buffer: torch.Tensor, group: dist.ProcessGroup) -> float:
    """Largest |symm_mem - NCCL| over random tensors (seeded per rank), eagerly and from a
    captured graph, for a fresh tensor and one at an aligned offset in a larger allocation;
    the ranks' largest. Exact (0.0) expected with 2 ranks: the sum of two values has one
    rounding whatever the algorithm."""
    gen = torch.Generator(device=buffer.device).manual_seed(1234 + group.rank())
    src = torch.randn(numel, generator=gen, device=buffer.device, dtype=torch.float32)
    src = src.to(buffer.dtype)
    want = src.clone()
    dist.all_reduce(want, group=group)
    worst = 0.0
    for offset in (0, 16):  # 16 elements: 32 or 64 bytes, still 16-byte aligned
        base = torch.empty(numel + offset, dtype=buffer.dtype, device=buffer.device)
        x = base[offset:]
        x.copy_(src)
        symm_all_reduce(x, buffer, group.group_name, algo)
        worst = max(worst, (x.float() - want.float()).abs().max().item())
        x.copy_(src)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            symm_all_reduce(x, buffer, group.group_name, algo)
        for _ in range(2):  # replayed twice: the graph runs again on fresh input
            x.copy_(src)
            g.replay()
            torch.cuda.synchronize()
            worst = max(worst, (x.float() - want.float()).abs().max().item())
        g.reset()
    t = torch.tensor([worst], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def format_table(record: dict) -> str:
    algos = [a for a in (NCCL, ONE_SHOT, TWO_SHOT) if f"{a}_us" in (record["rows"] or [{}])[0]]
    head = ["hidden", "tokens", "KiB"] + [f"{a} us" for a in algos] + ["fastest", "engine"]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in record["rows"]:
        cells = [str(r["hidden"]), str(r["tokens"]), f"{r['bytes'] / 1024:.1f}"]
        cells += [f"{r[f'{a}_us']:.2f}" for a in algos] + [r["fastest"], r["engine"]]
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    record = run(ns)
    print(f"[allreduce] {record['gpus']} x {record['device']}, torch {record['torch']}, "
          f"{record['dtype']}; {record['calls']} calls per graph, best of {record['trials']} "
          "replays, the ranks' largest time")
    if record["symm_mem_unavailable"]:
        print(f"[allreduce] symmetric memory unavailable: {record['symm_mem_unavailable']}")
    for hidden, report in record["engine"].items():
        print(f"[allreduce] engine auto, hidden {hidden}: {report['summary']} "
              f"({report['reason']})")
    print(format_table(record))
    diffs = {k: r[k] for r in record["rows"] for k in r if k.endswith("_max_diff") and r[k]}
    if diffs:
        print(f"[allreduce] symmetric-memory sums differ from NCCL's: {diffs}")
    if ns.json:
        Path(ns.json).write_text(json.dumps(record, indent=2))
        print(f"[allreduce] wrote {ns.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
