"""Regenerate the strategy comparison of ``docs/benchmarks.md`` from one run of the bench
commands.

    PYTHONPATH=. python benchmarks/strategy_table.py --model llama3.2-1b       # on the GPU
    PYTHONPATH=. python benchmarks/strategy_table.py --tiny --modes eager,ragged \\
        --out /tmp/strategy --docs /tmp/strategy/benchmarks.md                 # CPU check

It runs, each in a fresh process (``--in-process``: in this one), and writes into ``--out``:

- ``decode.json``: ``bench decode`` at batch 1 and N requests for every mode (tok/s, p99 step
  interval, padding waste, capture seconds, graph MiB);
- ``profile.json``: a profiled batch-1 run of eager and the graphed default, whose step
  timeline (``profile/timeline_b1.png``) is the launch-overhead picture;
- ``peer.json``: the default mode against Hugging Face transformers (``--peer hf``);
- ``serve.json``: ``bench serve`` in process, Poisson arrivals at each of ``--rates``, every
  mode (the table shows ``--table-rate``);
- ``startup.json``: ``bench startup``, cold and warm, every mode (``--tiny``: a cold start
  of the graphed default only, as each start is a new process);

and PNGs next to each JSON. Then it replaces what lies between the ``strategy-table`` markers
of ``--docs`` (appending the section when the markers are absent) with tables, the pictures
and findings read off the numbers. ``--skip-run`` only re-renders from the JSON in ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from replaylm.bench.workload import rate_label

ROOT = Path(__file__).resolve().parents[1]
MODES = ("eager", "full", "piecewise", "full_and_piecewise", "ragged")
BEGIN = "<!-- strategy-table:begin -->"
END = "<!-- strategy-table:end -->"
PARTS = ("decode", "profile", "peer", "serve", "startup")


def commands(model: str, modes: list[str], out: Path, tiny: bool, rates: str,
             num_requests: int, batch: int) -> dict[str, list[str]]:
    """The ``replaylm`` argument lists of one regeneration, by result name."""
    all_modes = ",".join(modes)
    graphed = next((m for m in ("ragged", *modes) if m != "eager" and m in modes), modes[0])
    timeline = ",".join(dict.fromkeys(m for m in ("eager", graphed) if m in modes))
    engine = ["--model", model]
    decode = ["--new-tokens", "256"]
    serve = ["--input-len", "128", "--output-len", "256", "--len-dist", "exponential"]
    startup: list[str] = []
    if tiny:
        engine += ["--device", "cpu", "--graph-tiers", "1,8"]
        decode = ["--new-tokens", "4", "--prompt-len", "6", "--batched-prompt-len", "6",
                  "--repeats", "1", "--batched-requests", str(batch), "--batched-repeats", "1"]
        serve = ["--input-len", "8", "--output-len", "4", "--len-dist", "exponential"]
        startup = ["--cpu-kv-cache-gib", "0.05", "--starts", "cold"]
    batches = f"1,{batch}"
    return {
        "decode": ["bench", "decode", *engine, *decode, "--batch-sizes", batches, "--modes",
                   all_modes, "--json", str(out / "decode.json")],
        "profile": ["bench", "decode", *engine, *decode, "--batch-sizes", "1", "--modes",
                    timeline, *([] if tiny else ["--repeats", "1"]),
                    "--profile", str(out / "profile"),
                    "--json", str(out / "profile.json")],
        "peer": ["bench", "decode", *engine, *decode, "--batch-sizes",
                 "1" if tiny else batches, "--modes",
                 graphed, "--peer", "hf", *(["--peer-hf-modes", "generate"] if tiny else []),
                 "--json", str(out / "peer.json")],
        "serve": ["bench", "serve", *engine, *serve, "--modes", all_modes, "--request-rates",
                  rates, "--num-requests", str(num_requests), "--no-progress",
                  "--json", str(out / "serve.json")],
        "startup": ["bench", "startup", *engine, *startup, "--modes",
                    graphed if tiny else all_modes, "--json", str(out / "startup.json")],
    }


def run(cmds: dict[str, list[str]], out: Path, in_process: bool) -> None:
    """Run every command; stop at the first that fails. Each part's commit, date and command
    go into ``out/meta.json``, so a later ``--skip-run`` still names the code and the command
    that were measured."""
    meta_path = out / "meta.json"
    measured = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    for name, argv in cmds.items():
        print(f"[strategy] {name}: replaylm {' '.join(argv)}", flush=True)
        start = time.perf_counter()
        if in_process:
            from replaylm.cli.main import main as replaylm_main

            rc = replaylm_main(argv)
        else:
            env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep
                       + os.environ.get("PYTHONPATH", ""))
            rc = subprocess.run([sys.executable, "-m", "replaylm", *argv], env=env).returncode
        if rc != 0:
            raise SystemExit(f"[strategy] {name} failed with exit code {rc}")
        print(f"[strategy] {name} took {time.perf_counter() - start:.1f} s", flush=True)
        measured[name] = {"commit": _commit(), "date": datetime.date.today().isoformat(),
                          "argv": argv}
        meta_path.write_text(json.dumps(measured, indent=1))


def load(out: Path) -> dict[str, Any]:
    """Every result JSON found in ``out`` (missing parts are left out)."""
    found = {}
    for name in PARTS:
        path = out / f"{name}.json"
        if path.exists():
            found[name] = json.loads(path.read_text())
    return found


def _num(value: Any, fmt: str = ",.1f") -> str:
    return "–" if value is None else format(value, fmt)


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head),
            *("| " + " | ".join(r) + " |" for r in rows)]


def _best(items: dict[str, float | None], low: bool = False) -> tuple[str, float] | None:
    known = {k: v for k, v in items.items() if v is not None}
    if not known:
        return None
    key = (min if low else max)(known, key=known.get)
    return key, known[key]


def decode_table(decode: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """Per mode: batch 1 and batch N tok/s, p99 step interval, padding, capture figures."""
    rows = decode["rows"]
    big = max(r["batch"] for r in rows)
    by = {(r["mode"], r["batch"]): r for r in rows}
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    lines = []
    for m in modes:
        one, many = by.get((m, 1), {}), by.get((m, big), {})
        g = (many or one).get("graphs") or {}
        lines.append([f"`{m}`", _num(one.get("tok_s")), _num(one.get("step_ms_p99"), ".3f"),
                      _num(many.get("tok_s")), _num(many.get("step_ms_p99"), ".3f"),
                      _num(100 * many["padding_share"] if many.get("padding_share") is not None
                           else None) + "%", str(g.get("num_graphs", "–")),
                      _num(g.get("capture_seconds"), ".2f"), _num(g.get("graph_mib"))])
    head = ["mode", "batch 1 tok/s", "batch 1 p99 step ms", f"{big} requests tok/s",
            f"{big} requests p99 step ms", f"{big} requests padding", "graphs", "capture s",
            "graph MiB"]
    facts = {"big": big, "b1": {m: by.get((m, 1), {}).get("tok_s") for m in modes},
             "bN": {m: by.get((m, big), {}).get("tok_s") for m in modes},
             "pad": {m: by.get((m, big), {}).get("padding_share") for m in modes if m != "eager"},
             "graphs": {m: (by.get((m, big)) or by.get((m, 1)) or {}).get("graphs") for m in modes}}
    return _table(head, lines), facts


def serve_table(serve: dict[str, Any], rate: str) -> tuple[list[str], dict[str, Any]]:
    """Per mode, the Poisson run at ``rate``: throughput, p99 latencies, goodput, padding."""
    if not any(r["rate_label"] == rate for r in serve["runs"]):
        rate = serve["runs"][0]["rate_label"]
    runs = [r for r in serve["runs"] if r["rate_label"] == rate]
    lines = [[f"`{r['mode']}`", _num(r["output_throughput"]), _num(r["ttft_ms"]["p99"], ".2f"),
              _num(r["tpot_ms"]["p99"], ".2f"), _num(r["itl_ms"]["p99"], ".2f"),
              _num(r["e2e_ms"]["p99"], ".1f"), _num(r["goodput"]["req_s"], ".2f"),
              _num(100 * r.get("padding_share", 0.0)) + "%"] for r in runs]
    head = ["mode", "output tok/s", "p99 TTFT ms", "p99 TPOT ms", "p99 ITL ms", "p99 E2E ms",
            "goodput req/s", "padding"]
    facts = {"tok": {r["mode"]: r["output_throughput"] for r in runs},
             "itl": {r["mode"]: r["itl_ms"]["p99"] for r in runs},
             "rate": rate}
    return _table(head, lines), facts


def startup_table(startup: dict[str, Any]) -> list[str]:
    rows = [r for r in startup["starts"] if "error" not in r]
    lines = [[f"`{r['mode']}`", r["start"], _num(r["ready_s"], ".2f"), _num(r["load_s"], ".2f"),
              _num(r.get("compile_ahead_s", 0.0), ".2f"), _num(r["tune_s"], ".2f"),
              _num(r["kv_sizing_s"], ".2f"), _num(r["capture_s"], ".2f"),
              _num(r["other_s"], ".2f"), _num(r["graph_mib"])] for r in rows]
    return _table(["mode", "start", "ready s", "weights s", "compiling ahead s", "tuning s",
                   "KV sizing s", "capture s", "other s", "graph MiB"], lines)


def peer_table(peer: dict[str, Any]) -> list[str]:
    lines = [[f"replaylm `{r['mode']}`", str(r["batch"]), _num(r["tok_s"]), "–", "–"]
             for r in peer["rows"]]
    own = {r["batch"]: r["tok_s"] for r in peer["rows"]}
    for p in peer["peers"]:
        ratio = f"{own[p['batch']] / p['tok_s']:.2f}×" if p.get("tok_s") and not p.get(
            "error") and p["batch"] in own else f"– ({p.get('error') or 'no figure'})"
        lines.append([f"HF `{p['mode']}`", str(p["batch"]), _num(p.get("tok_s")),
                      _num(p.get("first_call_s"), ".2f"), ratio])
    return _table(["engine", "batch", "tok/s", "first call s", "replaylm ÷ this"], lines)


def findings(d: dict[str, Any] | None, s: dict[str, Any] | None) -> list[str]:
    """Plain statements read off the numbers (which mode leads, by how much)."""
    out = []
    if d:
        for key, what in (("b1", "batch 1"), ("bN", f"{d['big']} requests")):
            best = _best(d[key])
            if best:
                eager = d[key].get("eager")
                vs = f", {best[1] / eager:.1f}× eager" if eager and best[0] != "eager" else ""
                out.append(f"- Decode, {what}: `{best[0]}` leads with {best[1]:,.1f} tok/s{vs}.")
        least = _best(d["pad"], low=True)
        if least:
            out.append(f"- Least padding at {d['big']} requests among graph modes: `{least[0]}` "
                       f"({100 * least[1]:.1f}% of the tokens its graphs ran).")
        graphs = {m: g for m, g in d["graphs"].items() if g and g.get("num_graphs")}
        for key, what, fmt, unit in (("num_graphs", "fewest graphs", "d", ""),
                                     ("capture_seconds", "shortest capture", ".2f", " s"),
                                     ("graph_mib", "least graph memory", ".1f", " MiB")):
            best = _best({m: g[key] for m, g in graphs.items()}, low=True)
            if best:
                out.append(f"- {what.capitalize()}: `{best[0]}` ({best[1]:{fmt}}{unit}).")
    if s:
        tok, itl = _best(s["tok"]), _best(s["itl"], low=True)
        if tok and itl:
            out.append(f"- Serving at {s['rate']} req/s: `{tok[0]}` has the most output tok/s "
                       f"({tok[1]:,.1f}); `{itl[0]}` the lowest p99 ITL ({itl[1]:.2f} ms).")
    return out


def render(results: dict[str, Any], out: Path, docs: Path, meta: dict[str, str],
           table_rate: str) -> str:
    """The whole section between the markers."""
    rel = Path(os.path.relpath(out, docs.parent))
    first = next(iter(results.values()), {})
    lines = [BEGIN, "", f"### Strategies side by side (`{meta['model']}`)", "",
             f"Measured {meta['date']} at commit {meta['commit']} on {first.get('device', '?')} "
             f"(torch {first.get('torch', '?')}); raw JSON and pictures in `{rel}/`. "
             "Written by `benchmarks/strategy_table.py`; edits here are overwritten."]
    if meta.get("tiny"):
        lines += ["", "**A CPU check with tiny settings on the built-in default model, not GPU "
                  "figures.**"]
    d = s = None
    if "decode" in results:
        table, d = decode_table(results["decode"])
        lines += ["", "Decode (`bench decode`; p99 step: 99th percentile of the time between "
                  "engine steps; padding: padded share of the tokens graphs ran):", "", *table]
    if "serve" in results:
        table, s = serve_table(results["serve"], table_rate)
        lines += ["", f"Serving, Poisson arrivals at {s['rate']} req/s (`bench serve`, in "
                  "process):", "", *table]
    if "startup" in results:
        lines += ["", "Engine start (`bench startup`, each in a fresh process; cold: empty "
                  "caches):", "", *startup_table(results["startup"])]
    if "peer" in results:
        lines += ["", "Against Hugging Face transformers (same checkpoint, prompts, protocol):",
                  "", *peer_table(results["peer"])]
    facts = findings(d, s)
    if facts:
        lines += ["", "Read off these numbers:", "", *facts]
    pictures = [("profile/timeline_b1.png", "one batch-1 decode step, eager above graphed"),
                ("decode_throughput.png", "tok/s by batch"), ("decode_padding.png", "padding"),
                ("decode_capture.png", "capture cost"), ("serve_latency.png",
                                                         "latency against request rate"),
                ("serve_throughput.png", "serving throughput"), ("startup_startup.png",
                                                                 "engine start"),
                ("peer_throughput.png", "replaylm and transformers")]
    shown = [(p, alt) for p, alt in pictures if (out / p).exists()]
    if shown:
        lines += [""] + [f"![{alt}]({(rel / p).as_posix()})" for p, alt in shown]
    shown_cmds = [" ".join(_from_root(a) for a in c) for c in meta["commands"]]
    lines += ["", "Commands (`replaylm ...`, from the repository root):", "", "```bash",
              *shown_cmds, "```", "", END]
    return "\n".join(lines) + "\n"


def _from_root(arg: str) -> str:
    """A path inside the checkout, relative to its root (commands read the same anywhere)."""
    return os.path.relpath(arg, ROOT) if arg.startswith(str(ROOT) + os.sep) else arg


def replace_section(doc: str, section: str) -> str:
    """``doc`` with the text between the markers (markers included) replaced by ``section``,
    or with ``section`` appended when there are no markers."""
    if BEGIN in doc and END in doc:
        head, rest = doc.split(BEGIN, 1)
        tail = rest.split(END, 1)[1]
        return head + section.rstrip("\n") + tail
    return doc.rstrip("\n") + "\n\n" + section


def _commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True,
                              text=True).stdout.strip()

    rev = git("rev-parse", "--short", "HEAD") or "unknown"
    return rev + (" (with uncommitted changes)" if git("status", "--porcelain", "--", "replaylm")
                  else "")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model (default: llama3.2-1b; --tiny: default)")
    p.add_argument("--modes", default=",".join(MODES), help="graph modes (default: all five)")
    p.add_argument("--batch", type=int, default=None,
                   help="requests of the batched decode row (default: 256; --tiny: 3)")
    p.add_argument("--rates", default=None,
                   help="bench serve rates (default: 16,64,inf; --tiny: 20,inf)")
    p.add_argument("--table-rate", default=None,
                   help="the rate the serving table shows (default: the first of --rates)")
    p.add_argument("--num-requests", type=int, default=None,
                   help="bench serve requests per run (default: 256; --tiny: 4)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "strategy"),
                   help="where the JSON and PNGs go (default: benchmarks/results/strategy)")
    p.add_argument("--docs", default=str(ROOT / "docs" / "benchmarks.md"),
                   help="the Markdown file whose strategy section is rewritten")
    p.add_argument("--tiny", action="store_true",
                   help="CPU, built-in default model, tiny settings: checks the pipeline")
    p.add_argument("--in-process", action="store_true",
                   help="run the commands in this process instead of one process each")
    p.add_argument("--parts", default=",".join(PARTS),
                   help=f"which commands to run (default: all of {','.join(PARTS)}); the "
                   "section is rendered from every JSON found in --out")
    p.add_argument("--skip-run", action="store_true", help="only re-render from --out")
    ns = p.parse_args(argv)
    modes = [m.strip() for m in ns.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        p.error(f"--modes takes a subset of {','.join(MODES)}")
    parts = [x.strip() for x in ns.parts.split(",") if x.strip()]
    if not parts or any(x not in PARTS for x in parts):
        p.error(f"--parts takes a subset of {','.join(PARTS)}")
    model = ns.model or ("default" if ns.tiny else "llama3.2-1b")
    rates = ns.rates or ("20,inf" if ns.tiny else "16,64,inf")
    out, docs = Path(ns.out).resolve(), Path(ns.docs).resolve()
    cmds = commands(model, modes, out, ns.tiny, rates,
                    ns.num_requests or (4 if ns.tiny else 256), ns.batch or (3 if ns.tiny else 256))
    if not ns.skip_run:
        out.mkdir(parents=True, exist_ok=True)
        run({name: cmds[name] for name in parts}, out, ns.in_process)
    results = load(out)
    if not results:
        raise SystemExit(f"[strategy] no results in {out}")
    measured = json.loads((out / "meta.json").read_text()) if (out / "meta.json").exists() else {}
    runs = [measured.get(name, {"commit": _commit(), "date": datetime.date.today().isoformat()})
            for name in results]
    meta = {"model": model, "date": max(r["date"] for r in runs),
            "commit": ", ".join(dict.fromkeys(r["commit"] for r in runs)),
            "tiny": "yes" if ns.tiny else "",
            "commands": [measured.get(name, {}).get("argv", cmds[name])
                         for name in PARTS if name in results]}
    label = rate_label(float(ns.table_rate or rates.split(",")[0]))
    section = render(results, out, docs, meta, label)
    docs.write_text(replace_section(docs.read_text() if docs.exists() else "", section))
    print(f"[strategy] wrote the strategy section of {docs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
