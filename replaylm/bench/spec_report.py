"""What ``bench spec`` reports: each row's speedup over plain decoding, the plain-text
table, and the JSON record with its PNG plots."""

from __future__ import annotations

from typing import Any

from replaylm.bench.common import draw, png_path, write_json


def add_speedups(rows: list[dict[str, Any]]) -> None:
    """``speedup``: tok/s over plain decoding's on the same prompts (part and batch)."""
    plain = {(r["part"] if r["part"] != "draft" else "acceptance", r["batch"]): r["tok_s"]
             for r in rows if r.get("config") == "plain" and r.get("tok_s")}
    for r in rows:
        base = plain.get(("acceptance" if r["part"] == "draft" else r["part"], r["batch"]))
        if r["part"] != "verify" and r.get("tok_s") and base:
            r["speedup"] = r["tok_s"] / base


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = []
    ver = [r for r in rows if r["part"] == "verify"]
    if ver:
        lines.append(f"(a) verify step, K={ver[0]['k']}: median ms per step "
                     "(padded waste of verify steps' tokens)")
        lines.append(f"{'layout':<8} {'dist':<8} " + " ".join(
            f"{'batch ' + str(b):>20}" for b in sorted({r['batch'] for r in ver})))
        for layout in dict.fromkeys(r["layout"] for r in ver):
            for dist in dict.fromkeys(r["distribution"] for r in ver):
                cells = [f"{r['step_ms_median']:>9.3f} ({100 * r['padded_waste']:5.1f}%)"
                         for r in sorted(ver, key=lambda r: r["batch"])
                         if r["layout"] == layout and r["distribution"] == dist]
                lines.append(f"{layout:<8} {dist:<8} " + " ".join(f"{c:>20}" for c in cells))
    for part, title in (("acceptance", "(b) controlled drafter"), ("ngram", "(c) n-gram"),
                        ("draft", "(d) draft model")):
        sel = [r for r in rows if r["part"] == part]
        if not sel:
            continue
        lines.append(f"{title}: tok/s, speedup over plain, mean accepted length, budget "
                     "(draft tokens per step)")
        for r in sel:
            if r.get("error"):
                lines.append(f"  {r['config']:<22} batch {r['batch']:>3}: {r['error']}")
                continue
            p = f" p={r['p']}" if r.get("p") is not None else ""
            extra = ""
            if r.get("mean_accepted_length") is not None:
                extra = (f"  accepted {r['mean_accepted_length']:.2f}/verify "
                         f"(per token {r['per_token_acceptance']:.3f})  budget "
                         f"{r['budget_tokens_per_step']:.2f}")
            if r.get("pipelined_steps"):
                extra += f"  pipelined {r['pipelined_steps']}/{r['verify_steps']}"
            if r.get("budget") == "adaptive" and r.get("verify_steps"):
                extra += (f"  verify expected {r['expected_tokens_per_verify']:.1f} tok in "
                          f"{r['priced_ms_per_verify']:.2f} ms, measured "
                          f"{r['measured_tokens_per_verify']:.1f} in "
                          f"{r['measured_ms_per_verify']:.2f}")
            lines.append(f"  {r['config']:<22}{p:<7} batch {r['batch']:>3}: "
                         f"{r['tok_s']:>10,.1f} tok/s  x{r.get('speedup', 0):.2f}{extra}")
    return "\n".join(lines)


def write_report(path: str, rows: list[dict[str, Any]], about: dict[str, Any]) -> None:
    """The JSON record (``about``: the command line, torch, device, model and settings; then
    the rows) at ``path``, and the PNG plots next to it: ``_verify`` with part (a),
    ``_acceptance`` with (b), ``_drafters`` with (c) or (d)."""
    write_json(path, {**about, "rows": rows})
    title = f"{about['model']} on {about['device']}"
    figures = []
    if any(r["part"] == "verify" for r in rows):
        figures.append(("spec_verify", (rows, png_path(path, "verify"), title)))
    if any(r["part"] == "acceptance" and r.get("p") is not None for r in rows):
        figures.append(("spec_acceptance", (rows, png_path(path, "acceptance"), title)))
    if any(r["part"] in ("ngram", "draft") and r.get("tok_s") for r in rows):
        figures.append(("spec_drafters", (rows, png_path(path, "drafters"), title)))
    draw(figures)
