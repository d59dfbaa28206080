"""Interleaved A/B of ``replaylm bench decode`` across engine settings and checkouts.

    PYTHONPATH=. python benchmarks/ab.py --rounds 2 \\
        --variant base= --variant nopdl=--pdl=off --variant old@/tmp/old= \\
        -- --model qwen3-0.6b --batch-sizes 1 --modes ragged

Each ``--variant`` is ``NAME[@DIR]=[FLAGS]``:

- ``FLAGS``: extra ``replaylm bench decode`` flags for this variant, split as a shell would
  (``'nopdl=--pdl off'`` or ``nopdl=--pdl=off``). They follow the shared arguments after
  ``--``, so they override them.
- ``DIR``: a checkout put first on ``PYTHONPATH``, so this variant runs that tree's replaylm,
  e.g. a worktree of an older commit (``git worktree add /tmp/old REV``). Without it the
  variant runs whatever replaylm the environment imports (from the repo root with
  ``PYTHONPATH=.``: this checkout). A variant with a ``DIR`` also gets its own cache
  directory, ``$REPLAYLM_CACHE/ab/NAME``: the kernel tuning table keeps one kernel-source
  digest's decisions, so checkouts sharing it would evict each other and re-tune (and maybe
  pick other tiles) in every process.

Every (round, variant) runs ``replaylm bench decode`` in a fresh process (``python -P``, so the
current directory cannot shadow ``DIR``). Rounds alternate the variants' order (odd rounds
run them in reverse), so a drift of the machine over the run does not favour the variant that
always runs first. It then prints every row's tok/s per round, the median, and the median's
change against the first variant. A variant whose run fails is reported with its error; the
other variants still run. ``--json OUT`` writes every run and the summary.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

#: ``-P`` (Python 3.11+): the child's ``sys.path`` starts with ``PYTHONPATH``, not the
#: current directory, so a variant's checkout is the replaylm it imports.
SAFE_PATH = ["-P"] if sys.version_info >= (3, 11) else []


@dataclass(frozen=True)
class Variant:
    name: str
    args: tuple[str, ...] = ()  # extra ``bench decode`` flags
    path: str | None = None  # a checkout to put first on PYTHONPATH


def parse_variant(spec: str) -> Variant:
    """``NAME[@DIR]=[FLAGS]`` (``NAME`` alone: no flags, this environment's replaylm)."""
    head, _, flags = spec.partition("=")
    name, at, path = head.partition("@")
    name, path = name.strip(), path.strip()
    if not name:
        raise ValueError(f"variant {spec!r} has no name (expected NAME[@DIR]=[FLAGS])")
    if at and not path:
        raise ValueError(f"variant {spec!r}: '@' must be followed by a checkout directory")
    try:
        args = tuple(shlex.split(flags))
    except ValueError as e:
        raise ValueError(f"variant {spec!r}: cannot split its flags: {e}") from e
    if any(a == "--json" or a.startswith("--json=") for a in args):
        raise ValueError(f"variant {spec!r}: --json is set per run by the A/B itself")
    return Variant(name, args, path or None)


def cache_root(env: dict[str, str]) -> Path:
    """replaylm's cache directory under ``env``: ``$REPLAYLM_CACHE``, else ~/.cache/replaylm."""
    return Path(env.get("REPLAYLM_CACHE") or Path.home() / ".cache" / "replaylm")


def variant_env(variant: Variant, base: dict[str, str]) -> dict[str, str]:
    """``base`` with the variant's checkout, if any, first on ``PYTHONPATH`` and its own
    cache directory (``ab/NAME`` under the usual one)."""
    env = dict(base)
    if variant.path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (variant.path, base.get("PYTHONPATH"))
                                            if p)
        env["REPLAYLM_CACHE"] = str(cache_root(base) / "ab" / variant.name)
    return env


def checkout_commit(path: str | Path) -> str | None:
    """``git rev-parse --short HEAD`` of ``path`` (``+dirty`` with tracked edits), or None."""
    try:
        rev = subprocess.run(["git", "-C", str(path), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(path), "status", "--porcelain",
                                "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return rev + ("+dirty" if dirty else "")


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


def bench_command(variant: Variant, bench_args: Sequence[str], json_out: str | Path) -> list[str]:
    """The child's command line: the shared arguments, then the variant's own flags."""
    return [sys.executable, *SAFE_PATH, "-m", "replaylm", "bench", "decode", *bench_args,
            *variant.args, "--json", str(json_out)]


def run_variants(variants: Sequence[Variant], rounds: int, bench_args: Sequence[str],
                 runner: Runner = _run_process, echo: Callable[[str], None] = print,
                 ) -> list[Run]:
    """Run ``replaylm bench decode BENCH_ARGS FLAGS`` per (round, variant) in ``schedule``
    order, each variant with its own flags and ``PYTHONPATH``."""
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for r, v in schedule(variants, rounds):
            out = Path(tmp) / f"{v.name}_{r}.json"
            proc = runner(bench_command(v, bench_args, out), variant_env(v, dict(os.environ)))
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
                                 usage="python benchmarks/ab.py [options] -- BENCH_ARGS")
    ap.add_argument("--variant", action="append", required=True, metavar="NAME[@DIR]=[FLAGS]",
                    help="a setting or checkout to compare; give two or more (the first is the "
                    "baseline). FLAGS: extra 'replaylm bench decode' flags; DIR: a checkout put "
                    "first on PYTHONPATH")
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
    for i, v in enumerate(variants):
        if v.path is not None:
            path = Path(v.path).expanduser().resolve()
            if not (path / "replaylm" / "__init__.py").is_file():
                ap.error(f"variant {v.name!r}: {v.path} is not a checkout (no replaylm/ in it)")
            variants[i] = Variant(v.name, v.args, str(path))
    if ns.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {ns.rounds}")
    if any(a == "--json" or a.startswith("--json=") for a in bench_args):
        ap.error("give --json before '--': each bench run writes its own")
    runs = run_variants(variants, ns.rounds, bench_args)
    lines = summarize(variants, runs)
    print(format_lines(lines))
    if ns.json:
        here = Path(__file__).resolve().parents[1]
        record = {"command": "python benchmarks/ab.py " + shlex.join(argv),
                  "bench_args": list(bench_args),
                  "checkout": checkout_commit(here),  # the tree holding this script
                  "variants": {v.name: {"args": list(v.args), "dir": v.path,
                                        "commit": checkout_commit(v.path) if v.path else None,
                                        "cache": variant_env(v, dict(os.environ)).get(
                                            "REPLAYLM_CACHE")}
                               for v in variants},
                  "runs": [asdict(r) for r in runs], "summary": [asdict(ln) for ln in lines]}
        Path(ns.json).write_text(json.dumps(record, indent=2))
        print(f"wrote {ns.json}")
    return 0 if lines and not any(r.error for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
