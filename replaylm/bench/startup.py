"""``replaylm bench startup``: how long an engine takes to start, cold and warm, and where the
time and memory go.

Every start runs in a fresh Python process (``python -m replaylm.bench.startup SPEC``), so
nothing compiled or loaded by an earlier start is still in memory:

- ``cold``: the replaylm cache (the user's kernel tuning cache, the built-in default model's
  weights) and Triton's kernel cache are a new empty directory, as on a new machine. The
  tuning table shipped for the GPU is part of the package, as a wheel ships it, so it still
  applies (``--no-shipped-tuning-table`` times every shape instead);
- ``warm``: the same directories again, as the cold start of that mode left them.

Each start reports, from the engine's own timers: weights (loading, or making dummy weights),
compiling ahead (the kernels of a compile plan, ``kernels.compile_plan``), kernel tuning, KV
sizing (the profiling forward and the pool), capture, and ``other`` (the rest of
``LLM(...)``: attention warm-up, sampler tables, scheduler); plus the interpreter start and
imports before it, and the first request after it (1 request, 8 new tokens). Memory: weights,
KV cache and graphs in MiB (on a GPU also the peak reserved).

Where the start's kernel decisions came from (``decisions``: the user's cache, the shipped
table, or timed now; ``tuning``: kernels compiled ahead, candidates timed and their
seconds), and on a GPU the seconds in Triton's compiler (``jit``: kernels compiled from
source or loaded from Triton's disk cache) during tuning, during capture and in all of
``LLM(...)``, so capture's own work shows apart from its JIT compiles.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from replaylm.bench.common import (
    add_modes_arg,
    command_line,
    draw,
    engine_args_for_mode,
    parse_modes,
    png_path,
    resolve_model_defaults,
    write_json,
)
from replaylm.config import EngineArgs

STARTS = ("cold", "warm")
PHASES = ("load_s", "compile_ahead_s", "tune_s", "kv_sizing_s", "capture_s", "other_s")
#: Where a kernel decision came from (``kernels.tuner.SOURCES``; spelled out here so the
#: bench reads it without importing Triton).
DECISION_SOURCES = ("cache", "shipped", "tuned")


def measure_start(args: EngineArgs, launched_at: float) -> dict[str, Any]:
    """Start one engine in this process and split its start (run inside the child)."""
    import torch

    from replaylm import LLM, SamplingParams
    from replaylm.bench.floor import weight_bytes_of
    from replaylm.engine.runner_setup import resolve_device
    from replaylm.kernels import jit_clock

    import_s = time.time() - launched_at
    cuda = resolve_device(args.device).type == "cuda"
    if cuda:
        jit_clock.install()
    jit_before = jit_clock.snapshot()
    start = time.perf_counter()
    llm = LLM.from_engine_args(args)
    if cuda:
        torch.cuda.synchronize()
    ready_s = time.perf_counter() - start
    runner = llm.engine.runner
    graphs = llm.graph_stats()
    plan = runner.compile_plan
    phases = {"load_s": runner.load_seconds, "compile_ahead_s": plan.seconds if plan else 0.0,
              "tune_s": runner.tune_seconds,
              "kv_sizing_s": runner.kv_sizing_seconds, "capture_s": graphs["capture_seconds"]}
    phases["other_s"] = max(0.0, ready_s - sum(phases.values()))
    jit = {"tune": runner.tune_jit, "capture": runner.capture_jit,
           "total": jit_clock.snapshot().since(jit_before)}
    decisions = decision_report()  # those of the start, not of the first request
    t0 = time.perf_counter()
    llm.generate([[1] * 8], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                 use_tqdm=False)
    if cuda:
        torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    return {
        "mode": llm.graph_mode, "device": str(llm.device), "import_s": import_s,
        "ready_s": ready_s, **phases, "first_request_s": first_s,
        "num_graphs": graphs["num_graphs"],
        "weights_mib": weight_bytes_of(llm) / 2**20,
        "kv_mib": runner.num_blocks * runner.block_bytes / 2**20,
        "graph_mib": graphs["graph_mib"],
        "peak_reserved_mib": torch.cuda.max_memory_reserved() / 2**20 if cuda else None,
        **decisions,
        "compile_plan": None if plan is None else {
            "kernels": plan.submitted, "skipped": plan.skipped, "refused": plan.refused,
            "source": Path(plan.source).name if plan.source else None},
        "jit": {phase: _rounded(totals.as_dict()) for phase, totals in jit.items()},
    }


def decision_report() -> dict[str, Any]:
    """This process's kernel decisions by source (``decisions``) and the tuner's work
    (``tuning``); zeros when the fused kernels never ran (CPU)."""
    tuner = sys.modules.get("replaylm.kernels.tuner")  # imported only where kernels run
    if tuner is None:
        return {"decisions": dict.fromkeys(DECISION_SOURCES, 0),
                "tuning": {"precompiled": 0, "precompile_s": 0.0, "candidates_timed": 0,
                           "timing_s": 0.0}}
    stats = _rounded(tuner.STATS.as_dict())
    return {"decisions": stats.pop("sources"), "tuning": stats}


def _rounded(d: dict[str, Any]) -> dict[str, Any]:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in d.items()}


def start_in_child(args: EngineArgs, cache: Path, timeout: float) -> dict[str, Any]:
    """One start in a fresh process whose caches live under ``cache``."""
    cache.mkdir(parents=True, exist_ok=True)
    out = cache / "start.json"
    spec = cache / "spec.json"
    spec.write_text(json.dumps({"engine_args": dataclasses.asdict(args), "out": str(out),
                                "launched_at": time.time()}))
    package_root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, REPLAYLM_CACHE=str(cache / "replaylm"),
               TRITON_CACHE_DIR=str(cache / "triton"),
               PYTHONPATH=package_root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "replaylm.bench.startup", str(spec)],
                          env=env, capture_output=True, text=True, timeout=timeout)
    process_s = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout)[-2000:]
        return {"error": f"exit {proc.returncode}: {tail}", "process_s": process_s}
    result = json.loads(out.read_text())
    result["process_s"] = process_s
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}


def run_startup_bench(base: EngineArgs, modes: list[str | None], starts: list[str],
                      repeats: int, cache_root: Path, timeout: float = 600.0,
                      log: Any = print) -> list[dict[str, Any]]:
    """Each start kind ``repeats`` times per mode; every mode has its own caches, emptied
    before each cold start (warm alone is preceded by one unrecorded start that fills them)."""
    rows = []
    for i, mode in enumerate(modes):
        args = engine_args_for_mode(base, mode)
        cache = cache_root / f"{i}-{mode or 'default'}"
        if "cold" not in starts:
            start_in_child(args, cache, timeout)
        for start in starts:
            for r in range(repeats):
                if start == "cold" and cache.exists():
                    shutil.rmtree(cache)
                row = {"start": start, "repeat": r, **start_in_child(args, cache, timeout)}
                row.setdefault("mode", mode or "default")
                log(_format_row(row))
                rows.append(row)
    return rows


def _format_row(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"[startup] mode={r['mode']} {r['start']}: failed: {r['error']}"
    parts = ", ".join(f"{k[:-2]} {r[k]:.2f}" for k in PHASES)
    return (f"[startup] mode={r['mode']} {r['start']}: ready in {r['ready_s']:.2f} s ({parts}); "
            f"imports {r['import_s']:.2f} s, first request {r['first_request_s']:.2f} s; "
            f"weights {r['weights_mib']:.0f} MiB, KV {r['kv_mib']:.0f} MiB, graphs "
            f"{r['graph_mib']:.0f} MiB ({r['num_graphs']}); {format_sources(r)}")


def format_sources(r: dict[str, Any]) -> str:
    """Where a start's kernel decisions came from, what the tuner did, and its JIT split."""
    d, t, jit = r["decisions"], r["tuning"], r["jit"]
    text = (f"kernel decisions: {d['cache']} from the user's cache, {d['shipped']} from the "
            f"shipped table, {d['tuned']} tuned now")
    plan = r.get("compile_plan")
    if plan:
        text += (f"; compile plan {plan['source']}: {plan['kernels']} kernels compiled in "
                 f"{r['compile_ahead_s']:.2f} s ({plan['skipped']} skipped, {plan['refused']} "
                 "refused)")
    if t["candidates_timed"] or t["precompiled"]:
        text += (f" ({t['precompiled']} kernels compiled ahead in {t['precompile_s']:.2f} s, "
                 f"{t['candidates_timed']} candidates timed in {t['timing_s']:.2f} s)")
    if jit["total"]["compiled"] or jit["total"]["loaded"]:
        text += "; Triton JIT " + ", ".join(
            f"{phase} {_jit_s(jit[phase]):.2f} s ({jit[phase]['compiled']} compiled, "
            f"{jit[phase]['loaded']} from disk)" for phase in ("tune", "capture", "total"))
    return text


def _jit_s(totals: dict[str, Any]) -> float:
    """Seconds in Triton's compiler: compiles from source and loads from its disk cache."""
    return totals["compile_s"] + totals["load_s"]


def format_table(rows: list[dict[str, Any]]) -> str:
    """One line per start: ready seconds and its phases, imports, first request, MiB."""
    head = (f"{'mode':<19} {'start':<5} {'ready s':>8} {'weights':>8} {'ahead':>7} {'tuning':>7} "
            f"{'KV size':>8} {'capture':>8} {'cap JIT':>7} {'other':>7} {'first req':>9} "
            f"{'w MiB':>8} {'KV MiB':>8} {'graph MiB':>9} {'cache/shipped/tuned':>19}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['mode']:<19} {r['start']:<5} failed")
            continue
        d = r["decisions"]
        lines.append(f"{r['mode']:<19} {r['start']:<5} {r['ready_s']:>8.2f} "
                     + " ".join(f"{r[k]:>{w}.2f}" for k, w in zip(PHASES[:5], (8, 7, 7, 8, 8)))
                     + f" {_jit_s(r['jit']['capture']):>7.2f} {r['other_s']:>7.2f}"
                     + f" {r['first_request_s']:>9.2f} {r['weights_mib']:>8.0f} "
                     f"{r['kv_mib']:>8.0f} {r['graph_mib']:>9.1f} "
                     f"{'/'.join(str(d[s]) for s in DECISION_SOURCES):>19}")
    return "\n".join(lines)


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Start kinds, repeats and output, plus every engine flag."""
    add_modes_arg(parser)
    parser.add_argument("--starts", default="cold,warm",
                        help="comma-separated start kinds: cold (empty caches), warm (the "
                        "caches the cold start left) (default: cold,warm)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="starts of each kind per mode (default: 1)")
    parser.add_argument("--cache-root", default=None, metavar="DIR",
                        help="where each mode's caches are made (default: a temporary "
                        "directory, removed afterwards)")
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="seconds one start may take (default: 900)")
    parser.add_argument("--json", metavar="OUT", default=None,
                        help="write every start here, and a PNG next to it (OUT stem + _startup)")
    EngineArgs.add_cli_args(parser, load_format=None, skip_tokenizer_init=None)
    return parser


def run_cli(ns: argparse.Namespace, argv: list[str] | None = None) -> int:
    """Entry point of ``replaylm bench startup``."""
    resolve_model_defaults(ns)
    starts = [s.strip() for s in ns.starts.split(",") if s.strip()]
    try:
        modes = parse_modes(ns.modes)
        if not starts or any(s not in STARTS for s in starts):
            raise ValueError(f"--starts takes {','.join(STARTS)}, got {ns.starts!r}")
        if ns.repeats < 1:
            raise ValueError("--repeats must be >= 1")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    base = EngineArgs.from_cli_args(ns)
    with tempfile.TemporaryDirectory(prefix="replaylm-startup-") as tmp:
        root = Path(ns.cache_root or tmp)
        rows = run_startup_bench(base, modes, starts, ns.repeats, root, ns.timeout)
    print(f"model {ns.model}")
    print(format_table(rows))
    ok = [r for r in rows if "error" not in r]
    if ns.json:
        write_json(ns.json, {"command": command_line(argv), "model": ns.model,
                             "engine_args": dataclasses.asdict(base), "starts": rows})
        if ok:
            draw([("startup", (ok, png_path(ns.json, "startup"),
                               f"{ns.model} on {ok[0]['device']}: engine start"))])
    return 0 if len(ok) == len(rows) else 1


def _child_main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    args = EngineArgs(**spec["engine_args"])
    Path(spec["out"]).write_text(json.dumps(measure_start(args, spec["launched_at"])))


if __name__ == "__main__":
    _child_main(sys.argv[1])
