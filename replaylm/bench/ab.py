"""Interleaved A/B of ``replaylm bench decode`` under different environment settings.

    python -m replaylm.bench.ab --rounds 2 \\
        --variant old:REPLAYLM_PDL_EARLY=0,REPLAYLM_ROPE_IN_ATTENTION=0 --variant new \\
        -- --model qwen3-0.6b --batch-sizes 1 --modes ragged

Many of the engine's policies are fixed when a module is imported (``REPLAYLM_PDL``,
``REPLAYLM_PDL_EARLY``, ``REPLAYLM_ROPE_IN_ATTENTION``, ...), so comparing them takes one
process per setting. This runs ``replaylm bench decode`` with the arguments after ``--`` once
per variant and round, each in a fresh process with the variant's variables added to the
environment. Rounds alternate the variants' order (odd rounds run them in reverse), so a
drift of the machine over the run does not favour the variant that always runs first. It
then prints every row's tok/s per round, the median, and the median's change against the
first variant. A variant whose run fails is reported with its error. The other variants
still run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Variant:
    name: str
    env: dict[str, str] = field(default_factory=dict)


def parse_variant(spec: str) -> Variant:
    """``NAME`` or ``NAME:VAR=VALUE[,VAR=VALUE...]``."""
    name, _, assignments = spec.partition(":")
    if not name.strip():
        raise ValueError(f"variant {spec!r} has no name (expected NAME[:VAR=VALUE,...])")
    env: dict[str, str] = {}
    for item in filter(None, (a.strip() for a in assignments.split(","))):
        var, eq, value = item.partition("=")
        if not eq or not var.strip():
            raise ValueError(f"variant {spec!r}: {item!r} is not VAR=VALUE")
        env[var.strip()] = value
    return Variant(name.strip(), env)


@dataclass
class Run:
    """One bench process: a variant in one round."""

    variant: str
    round: int
    rows: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None


def schedule(variants: Sequence[Variant], rounds: int) -> list[tuple[int, Variant]]:
    """(round, variant) in run order: forward in even rounds, reversed in odd ones."""
    order = []
    for r in range(rounds):
        for v in (variants if r % 2 == 0 else list(reversed(variants))):
            order.append((r, v))
    return order


Runner = Callable[[list[str], dict[str, str]], "subprocess.CompletedProcess[str]"]


def _run_process(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, env=env, capture_output=True, text=True)


def run_variants(variants: Sequence[Variant], rounds: int, bench_args: Sequence[str],
                 runner: Runner = _run_process, echo: Callable[[str], None] = print,
                 ) -> list[Run]:
    """Run ``replaylm bench decode BENCH_ARGS`` per (round, variant) in ``schedule`` order."""
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for r, v in schedule(variants, rounds):
            out = Path(tmp) / f"{v.name}_{r}.json"
            cmd = [sys.executable, "-m", "replaylm", "bench", "decode", *bench_args,
                   "--json", str(out)]
            proc = runner(cmd, os.environ | v.env)
            run = Run(v.name, r)
            if proc.returncode != 0:
                tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-5:]
                run.error = f"exit {proc.returncode}: " + " | ".join(tail)
            else:
                try:
                    run.rows = json.loads(out.read_text())["rows"]
                except (OSError, ValueError, KeyError) as e:
                    run.error = f"no rows in {out.name}: {e}"
            runs.append(run)
            echo(f"[ab] round {r} {v.name}: " + (run.error or ", ".join(
                f"{row['mode']} b{row['batch']} {row['tok_s']:,.1f} tok/s" for row in run.rows)))
    return runs


@dataclass
class Line:
    """One variant's figures for one (mode, batch) row."""

    variant: str
    mode: str
    batch: int
    tok_s: list[float]
    graph_nodes: int | None
    median: float
    change: float | None  # the median's change against the first variant's, as a fraction


def summarize(variants: Sequence[Variant], runs: Sequence[Run]) -> list[Line]:
    """Per (mode, batch) row and variant (in the order given): tok/s of each round, median,
    and the change against the first variant's median on the same row."""
    rows: dict[tuple[str, int], dict[str, list[dict[str, Any]]]] = {}
    for run in runs:
        for row in run.rows:
            rows.setdefault((row["mode"], row["batch"]), {}).setdefault(run.variant, []).append(row)
    lines = []
    for (mode, batch), by_variant in rows.items():
        base = None
        for v in variants:
            found = by_variant.get(v.name)
            if not found:
                continue
            tok_s = [r["tok_s"] for r in found]
            median = statistics.median(tok_s)
            if v is variants[0]:
                base = median
            change = None if base is None or v is variants[0] else median / base - 1
            lines.append(Line(v.name, mode, batch, tok_s, found[-1].get("graph_nodes"), median,
                              change))
    return lines


def format_lines(lines: Sequence[Line]) -> str:
    out = [f"{'variant':14s} {'mode':18s} {'batch':>5s}  {'median':>10s}  {'change':>7s}  "
           f"{'nodes':>5s}  tok/s per round"]
    for ln in lines:
        change = "–" if ln.change is None else f"{ln.change:+.1%}"
        nodes = "–" if ln.graph_nodes is None else str(ln.graph_nodes)
        out.append(f"{ln.variant:14s} {ln.mode:18s} {ln.batch:5d}  {ln.median:10,.1f}  "
                   f"{change:>7s}  {nodes:>5s}  " + "  ".join(f"{t:,.1f}" for t in ln.tok_s))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, bench_args = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv \
        else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 usage="python -m replaylm.bench.ab [options] -- BENCH_ARGS")
    ap.add_argument("--variant", action="append", required=True, metavar="NAME[:VAR=VALUE,...]",
                    help="a setting to compare; give two or more (the first is the baseline)")
    ap.add_argument("--rounds", type=int, default=2, help="runs per variant (default: 2)")
    ap.add_argument("--json", metavar="OUT", help="write every run and the summary here")
    ns = ap.parse_args(own)
    try:
        variants = [parse_variant(s) for s in ns.variant]
    except ValueError as e:
        ap.error(str(e))
    names = [v.name for v in variants]
    if len(set(names)) != len(names):
        ap.error(f"variant names must differ, got {names}")
    if ns.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {ns.rounds}")
    if any(a == "--json" or a.startswith("--json=") for a in bench_args):
        ap.error("give --json before '--': each bench run writes its own")
    runs = run_variants(variants, ns.rounds, bench_args)
    lines = summarize(variants, runs)
    print(format_lines(lines))
    if ns.json:
        record = {"command": "python -m replaylm.bench.ab " + " ".join(argv),
                  "variants": {v.name: v.env for v in variants},
                  "runs": [vars(r) for r in runs], "summary": [vars(ln) for ln in lines]}
        Path(ns.json).write_text(json.dumps(record, indent=2))
        print(f"wrote {ns.json}")
    return 0 if lines and not any(r.error for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
