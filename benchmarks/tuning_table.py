"""The kernel tuning tables replaylm ships (``replaylm/kernels/tuned/<gpu>.json``): measure
them on a GPU, then build or merge them.

    # on the GPU: every shape of these models timed from scratch, caches into OUT/
    PYTHONPATH=. python benchmarks/tuning_table.py measure \\
        --models llama3.2-1b,llama3-8b,qwen3-0.6b --out /tmp/tuning
    # anywhere: the shipped tables from those caches (merged with the tables already there)
    PYTHONPATH=. python benchmarks/tuning_table.py build /tmp/tuning/*.linear_tuning.json
    # on the GPU, with those tables built: each model's compile plan (``kernels.compile_plan``)
    PYTHONPATH=. python benchmarks/tuning_table.py plans \
        --models llama3.2-1b,llama3-8b,qwen3-0.6b --out /tmp/plans
    # anywhere: ship those plans
    PYTHONPATH=. python benchmarks/tuning_table.py ship-plans /tmp/plans/compile_plans/*.json

``measure`` starts each model once, in a fresh process with an empty replaylm cache and an
empty Triton cache and without the shipped table (``--no-shipped-tuning-table``), so the
engine times every projection shape its graphs use, as on a new machine; then it copies the
user cache that start wrote to ``OUT/<model>.linear_tuning.json`` and writes
``OUT/measure.json`` (each start's seconds and decisions). Every engine flag applies (e.g.
``--pdl off`` for the decisions made without PDL).

``plans`` starts each model once from empty caches *with* the shipped tables, as a user's
first start runs, and copies the compile plan it recorded (the kernel variants it compiled)
to ``OUT/compile_plans/``; ``ship-plans`` copies plans into ``replaylm/kernels/tuned/compile_plans/``
(package data), where a start whose user cache has no plan for its key finds them. Record
plans after building the tables and at the kernel sources that ship: a plan's entries name
their kernel's source revision, and a start skips those whose source has changed.

``winners`` counts, per row-block size, how often each tile (or the unfused path) won in
measured caches or tables: data for pruning ``skinny.CANDIDATES``.

``build`` reads measured caches, keeps the entries made for this checkout's kernel revision
(``kernels.tuner.kernels_revision``: entries from other kernel sources would never be used),
and writes one table per GPU model named in them, merged with that table's current entries:
an input's entry replaces the table's for the same key (same GPU, versions, PDL mode, shape),
and a later input wins over an earlier one. Entries of other revisions already in a table
are dropped. ``--dry-run`` prints what it would write.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

DEFAULT_MODELS = "llama3.2-1b,llama3-8b,qwen3-0.6b,qwen1.5-moe-a2.7b"


@dataclasses.dataclass
class MergeReport:
    """What a merge did to one table."""

    kept: int = 0  # the table's current entries no input touched
    added: int = 0  # keys new to the table
    replaced: int = 0  # keys the table had, now with an input's decision
    changed: int = 0  # replacements (of the table's or an earlier input's) with another config
    dropped_stale: int = 0  # table entries of another kernel revision


def check_entries(entries: Any, source: str) -> dict[str, list]:
    """``entries`` if it is a tuning cache (key -> ``[config or null, µs, unfused µs]``,
    config four ints, or five for a split-K tile); else ``ValueError`` naming ``source`` and
    the bad entry."""
    if not isinstance(entries, dict):
        raise ValueError(f"{source}: not a tuning cache (expected a JSON object)")
    for key, value in entries.items():
        ok = (isinstance(value, list) and len(value) == 3
              and all(isinstance(v, int | float) for v in value[1:])
              and (value[0] is None or (isinstance(value[0], list) and len(value[0]) in (4, 5)
                                        and all(isinstance(c, int) for c in value[0]))))
        if not ok:
            raise ValueError(f"{source}: entry {key!r} is not [config or null, us, unfused us]: "
                             f"{value!r}")
    return entries


def read_cache(path: Path) -> dict[str, list]:
    """A measured tuning cache (``ValueError`` naming the file when it is not one)."""
    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"{path}: cannot read: {e}") from e
    try:
        return check_entries(json.loads(text), str(path))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON: {e}") from e


def merge(table: dict[str, list], inputs: Sequence[dict[str, list]],
          revision: str) -> tuple[dict[str, list], MergeReport]:
    """``table``'s entries of ``revision`` overlaid with the inputs' entries of ``revision``
    (in order: a later input wins)."""
    from replaylm.kernels.tuning_cache import revision_of

    report = MergeReport()
    merged = {k: v for k, v in table.items() if revision_of(k) == revision}
    report.dropped_stale = len(table) - len(merged)
    touched: set[str] = set()
    for entries in inputs:
        for key, value in entries.items():
            if revision_of(key) != revision:
                continue
            old = merged.get(key)
            if old is None:
                report.added += 1
            else:
                report.replaced += key not in touched
                report.changed += old[0] != value[0]
            merged[key] = value
            touched.add(key)
    report.kept = len([k for k in merged if k not in touched])
    return merged, report


def by_gpu(entries: dict[str, list]) -> dict[str, dict[str, list]]:
    """Entries grouped by the GPU model their key names."""
    from replaylm.kernels.tuning_cache import gpu_of

    groups: dict[str, dict[str, list]] = {}
    for key, value in entries.items():
        groups.setdefault(gpu_of(key), {})[key] = value
    return groups


def build(paths: Sequence[Path], table_dir: Path, revision: str, dry_run: bool = False,
          log: Any = print) -> dict[str, MergeReport]:
    """Merge the caches at ``paths`` into the tables in ``table_dir`` (one per GPU model);
    returns each written table's report, keyed by file name."""
    from replaylm.kernels.tuning_cache import read_entries, revision_of, shipped_path

    inputs = []
    for path in paths:
        entries = read_cache(path)
        current = {k: v for k, v in entries.items() if revision_of(k) == revision}
        if len(current) < len(entries):
            log(f"{path}: {len(entries) - len(current)} of {len(entries)} entries are for "
                f"another kernel revision than this checkout's ({revision}): skipped")
        inputs.append(current)
    if not any(inputs):
        raise ValueError(f"no entry of kernel revision {revision} in {len(paths)} input(s): "
                         "measure with this checkout (benchmarks/tuning_table.py measure)")
    gpus = sorted({gpu for entries in inputs for gpu in by_gpu(entries)})
    reports = {}
    for gpu in gpus:
        path = shipped_path(gpu, table_dir)
        table = read_entries(path)
        merged, report = merge(table, [by_gpu(e).get(gpu, {}) for e in inputs], revision)
        reports[path.name] = report
        log(f"{path}: {len(merged)} entries for {gpu} (added {report.added}, replaced "
            f"{report.replaced}, kept {report.kept}, decisions changed {report.changed}, "
            f"other revisions dropped {report.dropped_stale})")
        if not dry_run:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(merged, indent=1, sort_keys=True) + "\n")
    return reports


def winners(tables: Sequence[dict[str, list]]) -> dict[int, dict[str, int]]:
    """How often each tile (``BLOCK_N x BLOCK_K / warps``) or the unfused path won, per
    row-block size (``BLOCK_M``, from the entry's row count), over the entries of
    ``tables``: which candidates a measured set of models never picks."""
    import re

    counts: dict[int, dict[str, int]] = {}
    for entries in tables:
        for key, (config, _, _) in entries.items():
            rows = int(re.search(r"\|(\d+)x\d+x\d+\|", key).group(1))
            block_m = 1 << (rows - 1).bit_length()
            name = "unfused" if config is None else f"{config[1]}x{config[2]}/{config[3]}"
            by_tile = counts.setdefault(block_m, {})
            by_tile[name] = by_tile.get(name, 0) + 1
    return counts


def format_winners(counts: dict[int, dict[str, int]]) -> list[str]:
    """One line per row-block size: the tiles that won, most wins first."""
    return [f"BLOCK_M {bm}: " + ", ".join(f"{name} {n}" for name, n in
                                          sorted(tiles.items(), key=lambda t: (-t[1], t[0])))
            for bm, tiles in sorted(counts.items())]


def measure(models: Sequence[str], out: Path, base: Any, timeout: float,
            log: Any = print) -> list[dict[str, Any]]:
    """Start each model once from empty caches without the shipped table; copy its tuning
    cache to ``out/<model>.linear_tuning.json``; returns each start's row (``bench startup``'s fields)."""
    from replaylm.bench.startup import start_in_child

    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for model in models:
        args = base.replace(model=model, shipped_tuning_table=False)
        with tempfile.TemporaryDirectory(prefix="replaylm-tuning-") as tmp:
            row = {"model": model, **start_in_child(args, Path(tmp), timeout)}
            cache = Path(tmp) / "replaylm" / "linear_tuning.json"
            if "error" not in row:
                if cache.exists():
                    saved = out / f"{model}.linear_tuning.json"
                    shutil.copyfile(cache, saved)
                    row["cache"] = str(saved)
                else:
                    row["error"] = "the start wrote no tuning cache (fused kernels off, or no GPU?)"
        rows.append(row)
        if "error" in row:
            log(f"[tuning] {model}: failed: {row['error']}")
        else:
            log(f"[tuning] {model}: tuned in {row['tune_s']:.2f} s, decisions "
                f"{row['decisions']}, {row['tuning']['candidates_timed']} candidates timed; "
                f"ready in {row['ready_s']:.2f} s -> {row['cache']}")
    (out / "measure.json").write_text(json.dumps({"starts": rows}, indent=1))
    return rows


def record_plans(models: Sequence[str], out: Path, base: Any, timeout: float,
                 log: Any = print) -> list[dict[str, Any]]:
    """Start each model once from empty caches (shipped tables on); copy the compile plan it
    recorded into ``out/compile_plans``; returns each start's row (``bench startup``'s
    fields)."""
    from replaylm.bench.startup import start_in_child

    (out / "compile_plans").mkdir(parents=True, exist_ok=True)
    rows = []
    for model in models:
        with tempfile.TemporaryDirectory(prefix="replaylm-plans-") as tmp:
            row = {"model": model, **start_in_child(base.replace(model=model), Path(tmp),
                                                    timeout)}
            plans = sorted((Path(tmp) / "replaylm" / "compile_plans").glob("*.json"))
            if "error" not in row and not plans:
                row["error"] = "the start recorded no compile plan (no GPU, or compile_ahead off?)"
            row["plans"], row["kernels"] = [], 0
            for plan in plans:
                shutil.copyfile(plan, out / "compile_plans" / plan.name)
                row["plans"].append(str(out / "compile_plans" / plan.name))
                row["kernels"] += len(json.loads(plan.read_text())["kernels"])
        rows.append(row)
        if "error" in row:
            log(f"[plans] {model}: failed: {row['error']}")
        else:
            log(f"[plans] {model}: ready in {row['ready_s']:.2f} s, {row['kernels']} kernels -> "
                + ", ".join(row["plans"]))
    (out / "plans.json").write_text(json.dumps({"starts": rows}, indent=1))
    return rows


def ship_plans(paths: Sequence[Path], plan_dir: Path, log: Any = print) -> None:
    """Copy compile plans into ``plan_dir``; ``ValueError`` naming a file that is not one
    (nothing is copied then)."""
    for path in paths:
        try:
            kernels = json.loads(path.read_text())["kernels"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: not a compile plan ({e})") from None
        if not isinstance(kernels, list) or not all(
                isinstance(k, dict) and {"fn", "fn_key", "data"} <= k.keys() for k in kernels):
            raise ValueError(f"{path}: not a compile plan (bad kernel entries)")
    plan_dir.mkdir(parents=True, exist_ok=True)
    for path in paths:
        shutil.copyfile(path, plan_dir / path.name)
        log(f"[tuning] {path.name} -> {plan_dir}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="write the shipped tables from measured caches")
    b.add_argument("caches", nargs="+", type=Path, help="measured linear_tuning.json files")
    b.add_argument("--table-dir", type=Path, default=ROOT / "replaylm" / "kernels" / "tuned",
                   help="where the tables are (default: replaylm/kernels/tuned)")
    b.add_argument("--dry-run", action="store_true", help="report, write nothing")
    p = sub.add_parser("ship-plans", help="copy compile plans into the shipped ones")
    p.add_argument("plans", nargs="+", type=Path, help="compile plans (the plans command's OUT)")
    p.add_argument("--plan-dir", type=Path,
                   default=ROOT / "replaylm" / "kernels" / "tuned" / "compile_plans",
                   help="where the shipped plans are (default: replaylm/kernels/tuned/"
                   "compile_plans)")
    w = sub.add_parser("winners", help="how often each tile won in measured caches or tables")
    w.add_argument("caches", nargs="+", type=Path, help="tuning caches or shipped tables")
    from replaylm.config import EngineArgs

    for name, text in (("measure", "time every shape of some models on this GPU"),
                       ("plans", "record some models' compile plans on this GPU")):
        m = sub.add_parser(name, help=text)
        m.add_argument("--models", default=DEFAULT_MODELS,
                       help=f"comma-separated models (default: {DEFAULT_MODELS})")
        m.add_argument("--out", type=Path, required=True, help="where the files go")
        m.add_argument("--timeout", type=float, default=900.0,
                       help="seconds one start may take")
        EngineArgs.add_cli_args(m, load_format="dummy", skip_tokenizer_init=True)
    ns = parser.parse_args(argv)
    if ns.command == "build":
        from replaylm.kernels.tuner import kernels_revision

        try:
            build(ns.caches, ns.table_dir, kernels_revision(), ns.dry_run)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    if ns.command == "ship-plans":
        try:
            ship_plans(ns.plans, ns.plan_dir)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    if ns.command == "winners":
        try:
            tables = [read_cache(path) for path in ns.caches]
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print("\n".join(format_winners(winners(tables))))
        return 0
    models = [x.strip() for x in ns.models.split(",") if x.strip()]
    if not models:
        print("error: --models names no model", file=sys.stderr)
        return 2
    if ns.command == "plans":
        rows = record_plans(models, ns.out, EngineArgs.from_cli_args(ns), ns.timeout)
        print("next: PYTHONPATH=. python benchmarks/tuning_table.py ship-plans "
              + " ".join(p for r in rows for p in r.get("plans", [])))
        return 0 if all("error" not in r for r in rows) else 1
    rows = measure(models, ns.out, EngineArgs.from_cli_args(ns), ns.timeout)
    print("next: PYTHONPATH=. python benchmarks/tuning_table.py build "
          + " ".join(r["cache"] for r in rows if "cache" in r))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
