"""What it costs to bring captured graphs up to date after memory changes (a CUDA GPU).

    PYTHONPATH=. python benchmarks/graph_update.py --model llama3.2-1b llama3-8b --json gu.json

replaylm keeps every address its graphs hold (weights updated in place, sleep and KV resize
on address-stable memory), so its answer is (a). This measures the two answers an engine
needs where an address does move, on every graph one engine captured (the default graph mode
and tiers of each named shape, dummy weights):

- (a) nothing: the addresses are stable; the cost is the pointer audit that confirms it
  (``LLM.audit_graphs``);
- (b) exec update: capture the graph's function again (no warm-up: kernels are compiled) and
  patch the instantiated graph with ``cuGraphExecUpdate`` from the fresh capture (through
  ``cuda.bindings.driver``); the patched graph is replayed and must write what a replay of the
  fresh capture writes, bit for bit; then it is patched back from its own kept graph
  (``keep_graph=True``) so the engine goes on as before;
- (c) recapture: the same capture, then ``instantiate`` a new executable graph.

Per shape it prints the three totals over all graphs (capture and update or instantiate
seconds apart) with the graph count and how many updates the driver refused (a topology
change: (b) falls back to (c) for those), and writes the per-graph rows with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

UPDATE_RESULTS = {0: "success", 1: "error", 2: "topology changed", 3: "node type changed",
                  4: "function changed", 5: "parameters changed", 6: "not supported",
                  7: "unsupported function change", 8: "attributes changed"}


def _driver() -> Any:
    from cuda.bindings import driver

    return driver


def _graph_handle(graph: torch.cuda.CUDAGraph) -> Any:
    """The graph's ``CUgraph`` (a kept graph: readable before and after instantiation), as
    the driver bindings take it."""
    raw = graph.raw_cuda_graph()
    return _driver().CUgraph(init_value=int(raw)) if isinstance(raw, int) else raw


def _exec_handle(graph: torch.cuda.CUDAGraph) -> Any:
    """The graph's ``CUgraphExec`` (it must be instantiated), as the driver bindings take it."""
    raw = graph.raw_cuda_graph_exec()
    return _driver().CUgraphExec(init_value=int(raw)) if isinstance(raw, int) else raw


def exec_update(target: torch.cuda.CUDAGraph, source_graph: Any) -> str:
    """Patch ``target``'s executable graph with the node parameters of ``source_graph`` (a
    ``CUgraph``); returns the driver's result name ("success" when patched)."""
    out = _driver().cuGraphExecUpdate(_exec_handle(target), source_graph)
    status, info = (out[0], out[1]) if isinstance(out, tuple) else (out, None)
    result = getattr(info, "result", None)
    code = int(getattr(result, "value", result)) if result is not None else None
    if int(getattr(status, "value", status)) == 0:
        return "success"
    return UPDATE_RESULTS.get(code, f"{status!r}")


def _fresh(graph) -> tuple[torch.cuda.CUDAGraph, list[torch.Tensor], float]:
    """``graph``'s function captured again into a kept, not yet instantiated graph (the same
    memory pool); its outputs and the seconds the capture took."""
    fresh = torch.cuda.CUDAGraph(keep_graph=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.cuda.graph(fresh, pool=graph.pool):
        outs = list(graph.fn())
    torch.cuda.synchronize()
    return fresh, outs, time.perf_counter() - t0


def _bits(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().contiguous().view(torch.uint8).clone() for t in ts]


@torch.inference_mode()
def measure_graph(graph, state: list[torch.Tensor] = ()) -> dict:
    """(b) and (c) for one captured ``graphs.graph.Graph``. ``state``: tensors outside the
    graph's static buffers that it both reads and writes (the runner's ``last_token``: a step
    samples into what the next one reads). Those and every static buffer (a piecewise link
    adds into its residual buffer in place) are put back before the fresh capture's replay,
    so both replays read the same inputs."""
    row: dict = {"graph": graph.name}
    # (b): a fresh capture, then patch the engine's executable graph from it.
    fresh, outs, row["capture_s"] = _fresh(graph)
    src = _graph_handle(fresh)
    t0 = time.perf_counter()
    row["update_result"] = exec_update(graph.graph, src)
    torch.cuda.synchronize()
    row["update_s"] = time.perf_counter() - t0
    if row["update_result"] == "success":
        inputs = [*state, *(t for get in graph.static.values()
                             if isinstance(t := get(), torch.Tensor))]
        kept = [t.clone() for t in inputs]
        graph.graph.replay()  # now writes where the fresh capture writes
        patched = _bits(outs)
        for t, k in zip(inputs, kept, strict=True):
            t.copy_(k)
        fresh.instantiate()
        fresh.replay()
        row["update_bit_identical"] = all(torch.equal(a, b) for a, b in
                                          zip(patched, _bits(outs), strict=True))
        own = _graph_handle(graph.graph)  # back to the engine's own addresses
        row["restore_result"] = exec_update(graph.graph, own)
    del fresh, outs
    # (c): a fresh capture, then a new executable graph.
    fresh, outs, capture2 = _fresh(graph)
    t0 = time.perf_counter()
    fresh.instantiate()
    torch.cuda.synchronize()
    row["instantiate_s"] = time.perf_counter() - t0
    row["recapture_s"] = capture2 + row["instantiate_s"]
    row["exec_update_s"] = row["capture_s"] + row["update_s"]
    del fresh, outs
    return row


def summarize(model: str, rows: list[dict], audit_s: float) -> dict:
    """The three totals of one shape: (a) the audit, (b) capture + exec update (refused
    updates counted, and charged an instantiate as their fallback), (c) capture +
    instantiate."""
    refused = [r for r in rows if r["update_result"] != "success"]
    fallback = sum(r["instantiate_s"] for r in refused)
    return {
        "model": model, "graphs": len(rows),
        "nothing_audit_s": audit_s,
        "exec_update_s": sum(r["exec_update_s"] for r in rows) + fallback,
        "exec_update_only_s": sum(r["update_s"] for r in rows),
        "recapture_s": sum(r["recapture_s"] for r in rows),
        "instantiate_only_s": sum(r["instantiate_s"] for r in rows),
        "capture_only_s": sum(r["capture_s"] for r in rows),
        "updates_refused": len(refused),
        "updates_bit_identical": all(r.get("update_bit_identical", True) for r in rows),
    }


def table(summaries: list[dict]) -> str:
    head = ("| model | graphs | (a) nothing: audit s | (b) capture + exec update s "
            "(update alone) | (c) capture + instantiate s (instantiate alone) | "
            "updates refused | (b) bit-identical |")
    lines = [head, "|" + " --- |" * 7]
    for s in summaries:
        lines.append(
            f"| {s['model']} | {s['graphs']} | {s['nothing_audit_s']:.3f} | "
            f"{s['exec_update_s']:.3f} ({s['exec_update_only_s']:.3f}) | "
            f"{s['recapture_s']:.3f} ({s['instantiate_only_s']:.3f}) | "
            f"{s['updates_refused']} | {s['updates_bit_identical']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", nargs="+", default=["llama3.2-1b", "llama3-8b"])
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.8,
                    help="leaves room for the fresh captures beside the engine's graphs")
    ap.add_argument("--json", default=None)
    ns = ap.parse_args()
    from replaylm import LLM

    summaries, per_graph = [], {}
    for model in ns.model:
        llm = LLM(model, load_format="dummy", skip_tokenizer_init=True,
                  max_num_seqs=ns.max_num_seqs,
                  gpu_memory_utilization=ns.gpu_memory_utilization)
        graphs = llm.engine.runner.graphs.captured()
        t0 = time.perf_counter()
        llm.audit_graphs()
        audit_s = time.perf_counter() - t0
        state = [llm.engine.runner.graphs.last_token]
        rows = [measure_graph(g, state) for g in graphs]
        llm.audit_graphs()  # the engine's graphs hold their own addresses again
        summaries.append(summarize(model, rows, audit_s))
        per_graph[model] = rows
        llm.shutdown()
        del llm
        torch.cuda.empty_cache()
    print(table(summaries))
    if ns.json:
        Path(ns.json).write_text(json.dumps({"summaries": summaries, "graphs": per_graph},
                                            indent=1))


if __name__ == "__main__":
    main()
