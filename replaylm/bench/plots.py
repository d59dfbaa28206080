"""PNG figures of the bench commands, drawn with matplotlib's Agg backend (no display).

Each function takes the records a command writes to its JSON, so a figure can be redrawn from
the file alone, and saves one PNG. Importing this module needs matplotlib (the ``bench``
extra); commands that find it missing write their JSON and say the plots were skipped.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from replaylm.bench.timeline import Timeline

MODE_COLORS = {"eager": "#7f7f7f", "full": "#1f77b4", "piecewise": "#ff7f0e",
               "full_and_piecewise": "#2ca02c", "ragged": "#d62728"}
PALETTE = ["#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22"]
PERCENTILES = (("p50", ":"), ("p90", "--"), ("p99", "-"))


def color_of(mode: str, i: int = 0) -> str:
    """A fixed colour per graph mode (other labels cycle through a palette)."""
    return MODE_COLORS.get(mode, PALETTE[i % len(PALETTE)])


def _save(fig: Figure, path: str | Path) -> str:
    FigureCanvasAgg(fig)
    fig.savefig(str(path), dpi=110, bbox_inches="tight")
    return str(path)


def _plain(value: float, _: Any = None) -> str:
    return f"{value:,.3g}"


def _modes(records: Sequence[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(str(r["mode"]) for r in records))


def decode_throughput(rows: Sequence[dict[str, Any]], peers: Sequence[dict[str, Any]],
                      path: str | Path, title: str = "") -> str:
    """tok/s against batch size, one line per graph mode; peers (``--peer``) dashed."""
    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    for mode in _modes(rows):
        pts = sorted((r["batch"], r["tok_s"]) for r in rows if r["mode"] == mode)
        ax.plot(*zip(*pts), marker="o", color=color_of(mode), label=mode)
    ok = [p for p in peers if p.get("tok_s")]
    for i, label in enumerate(dict.fromkeys(f"{p['peer']} {p['mode']}" for p in ok)):
        pts = sorted((p["batch"], p["tok_s"]) for p in ok if f"{p['peer']} {p['mode']}" == label)
        ax.plot(*zip(*pts), marker="s", linestyle="--", color=PALETTE[i % len(PALETTE)], label=label)
    batches = sorted({r["batch"] for r in rows} | {p["batch"] for p in ok})
    if len(batches) > 1:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(_plain))
        ax.yaxis.set_minor_formatter(FuncFormatter(_plain))
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("batch (concurrent requests)")
    ax.set_ylabel("output tok/s")
    ax.set_title(title or "Decode throughput by batch")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def padding_waste(rows: Sequence[dict[str, Any]], path: str | Path, title: str = "") -> str:
    """Padded share of the tokens graphs ran, per mode (bars) and batch size (groups)."""
    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot()
    modes = _modes(rows)
    batches = sorted({r["batch"] for r in rows})
    width = 0.8 / max(1, len(batches))
    for j, b in enumerate(batches):
        vals = [next((100 * (r.get("padding_share") or 0.0) for r in rows
                      if r["mode"] == m and r["batch"] == b), 0.0) for m in modes]
        xs = [i + (j - (len(batches) - 1) / 2) * width for i in range(len(modes))]
        bars = ax.bar(xs, vals, width, label=f"batch {b}", color=PALETTE[j % len(PALETTE)])
        ax.bar_label(bars, fmt="%.1f%%", fontsize=7)
    ax.set_xticks(range(len(modes)), modes)
    ax.set_ylabel("padded tokens, % of tokens run in graphs")
    ax.set_title(title or "Padding waste per mode (eager runs no padding)")
    ax.legend(fontsize=8)
    return _save(fig, path)


def capture_cost(entries: Sequence[dict[str, Any]], path: str | Path, title: str = "") -> str:
    """Capture seconds and graph MiB per mode; each bar is labelled with its graph count."""
    fig = Figure(figsize=(9, 3.8))
    modes = _modes(entries)
    colors = [color_of(m) for m in modes]
    for k, (key, label) in enumerate((("capture_seconds", "capture seconds"),
                                      ("graph_mib", "graph memory, MiB"))):
        ax = fig.add_subplot(1, 2, k + 1)
        vals = [float(next(e for e in entries if e["mode"] == m).get(key) or 0.0) for m in modes]
        bars = ax.bar(range(len(modes)), vals, color=colors)
        graphs = [next(e for e in entries if e["mode"] == m).get("num_graphs", 0) for m in modes]
        ax.bar_label(bars, labels=[f"{v:.2f}\n{g} graphs" for v, g in zip(vals, graphs)],
                     fontsize=7)
        ax.set_xticks(range(len(modes)), modes, rotation=20, fontsize=8)
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0, top=max(vals + [1e-9]) * 1.3)
    fig.suptitle(title or "Capture cost per mode")
    return _save(fig, path)


def _rate_axis(runs: Sequence[dict[str, Any]]) -> tuple[list[str], dict[str, int]]:
    labels = list(dict.fromkeys(str(r["rate_label"]) for r in
                                sorted(runs, key=lambda r: r["request_rate"] or float("inf"))))
    return labels, {lab: i for i, lab in enumerate(labels)}


def latency_vs_rate(runs: Sequence[dict[str, Any]], path: str | Path, title: str = "") -> str:
    """TTFT, TPOT, ITL and end-to-end latency (p50 dotted, p90 dashed, p99 solid) against
    request rate, one colour per mode."""
    fig = Figure(figsize=(10, 7))
    labels, pos = _rate_axis(runs)
    metrics = (("ttft_ms", "TTFT"), ("tpot_ms", "time per output token"),
               ("itl_ms", "inter-token latency"), ("e2e_ms", "end-to-end latency"))
    for k, (key, name) in enumerate(metrics):
        ax = fig.add_subplot(2, 2, k + 1)
        for i, mode in enumerate(_modes(runs)):
            mine = sorted((r for r in runs if r["mode"] == mode), key=lambda r: pos[r["rate_label"]])
            for p, style in PERCENTILES:
                ys = [(r.get(key) or {}).get(p) for r in mine]
                pts = [(pos[r["rate_label"]], y) for r, y in zip(mine, ys) if y is not None]
                if pts:
                    ax.plot(*zip(*pts), linestyle=style, marker="o", markersize=3,
                            color=color_of(mode, i), label=f"{mode} {p}")
        ax.set_xticks(range(len(labels)), labels)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(f"{name}, ms")
        ax.set_title(name, fontsize=10)
        ax.grid(True, alpha=0.3)
        if k == 0:
            ax.legend(fontsize=7, ncol=2)
    fig.suptitle(title or "Latency percentiles against request rate")
    fig.tight_layout()
    return _save(fig, path)


def serving_throughput(runs: Sequence[dict[str, Any]], path: str | Path, title: str = "") -> str:
    """Output tok/s and goodput (requests/s meeting the SLO) against request rate."""
    fig = Figure(figsize=(10, 3.8))
    labels, pos = _rate_axis(runs)
    panels = (("output_throughput", "output tok/s"), ("goodput_req_s", "goodput, req/s"))
    for k, (key, name) in enumerate(panels):
        ax = fig.add_subplot(1, 2, k + 1)
        for i, mode in enumerate(_modes(runs)):
            mine = sorted((r for r in runs if r["mode"] == mode), key=lambda r: pos[r["rate_label"]])
            vals = [r["output_throughput"] if key == "output_throughput"
                    else r["goodput"]["req_s"] for r in mine]
            ax.plot([pos[r["rate_label"]] for r in mine], vals, marker="o",
                    color=color_of(mode, i), label=mode)
        ax.set_xticks(range(len(labels)), labels)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(name)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title or "Serving throughput against request rate")
    return _save(fig, path)


STARTUP_PHASES = (("load_s", "weights", "#9467bd"), ("compile_ahead_s", "compile ahead", "#7f7f7f"),
                  ("tune_s", "kernel tuning", "#8c564b"), ("kv_sizing_s", "KV sizing", "#e377c2"),
                  ("capture_s", "capture", "#17becf"), ("other_s", "other", "#bcbd22"))
STARTUP_MEMORY = (("weights_mib", "weights", "#9467bd"), ("kv_mib", "KV cache", "#7f7f7f"),
                  ("graph_mib", "graphs", "#17becf"))


def startup(rows: Sequence[dict[str, Any]], path: str | Path, title: str = "") -> str:
    """Engine start split into phases (seconds) and memory (MiB), per mode and start kind."""
    fig = Figure(figsize=(11, 1.4 + 0.45 * max(2, len(rows))))
    names = [f"{r['mode']} {r['start']}" for r in rows]
    for k, (parts, unit) in enumerate(((STARTUP_PHASES, "seconds"), (STARTUP_MEMORY, "MiB"))):
        ax = fig.add_subplot(1, 2, k + 1)
        left = [0.0] * len(rows)
        for key, label, color in parts:
            vals = [float(r.get(key) or 0.0) for r in rows]
            ax.barh(range(len(rows)), vals, left=left, label=label, color=color)
            left = [a + b for a, b in zip(left, vals)]
        for i, total in enumerate(left):
            ax.text(total, i, f" {total:,.1f}", va="center", fontsize=7)
        ax.set_yticks(range(len(rows)), names if k == 0 else [""] * len(rows), fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel(unit)
        ax.margins(x=0.15)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=len(parts))
    fig.suptitle(title or "Engine start: where the time and memory go")
    return _save(fig, path)


def step_timeline(timelines: Sequence[Timeline | dict[str, Any]], path: str | Path,
                  title: str = "") -> str:
    """One step per row on a shared time axis: each kernel a bar, each launch gap shaded red,
    the gap share written on the row. Eager above graphed shows what launch overhead costs."""
    tls = [t if isinstance(t, Timeline) else Timeline.from_dict(t) for t in timelines]
    fig = Figure(figsize=(11, 0.6 + 1.3 * max(1, len(tls))))
    axes = fig.subplots(len(tls), 1, sharex=True, squeeze=False)[:, 0]
    for ax, t in zip(axes, tls):
        ax.broken_barh([(s.start, s.end - s.start) for s in t.spans], (0.15, 0.7),
                       facecolors=color_of(t.label), edgecolor="black", linewidth=0.2)
        ax.broken_barh([(a, b - a) for a, b in t.gaps], (0, 1), facecolors="#ff000030")
        what = "kernels" if t.source == "device" else "host ops"
        ax.text(0.995, 0.93, f"{t.label}: {len(t.spans)} {what} in {t.window_us / 1e3:.3f} ms; "
                f"gaps {100 * t.gap_share:.1f}% ({t.gap_us / 1e3:.3f} ms)",
                transform=ax.transAxes, ha="right", va="top", fontsize=9,
                bbox={"facecolor": "white", "alpha": 0.8, "linewidth": 0})
        ax.set_yticks([0.5], [t.label])
        ax.set_ylim(0, 1.25)
    axes[-1].set_xlabel("µs from the step's first " + ("kernel" if tls and tls[0].source ==
                                                        "device" else "operator"))
    fig.suptitle(title or "One decode step: busy (bars) and launch gaps (red)")
    return _save(fig, path)


def spec_verify(rows: Sequence[dict[str, Any]], path: str | Path, title: str = "") -> str:
    """``bench spec`` (a): verify-step time (top) and padded waste (bottom) against batch
    size, one line per verify layout, one column per draft-length distribution."""
    ver = [r for r in rows if r["part"] == "verify"]
    dists = list(dict.fromkeys(r["distribution"] for r in ver))
    fig = Figure(figsize=(5 * len(dists), 7))
    axes = fig.subplots(2, len(dists), squeeze=False)
    layouts = list(dict.fromkeys(r["layout"] for r in ver))
    colors = {"ragged": MODE_COLORS["ragged"], "padded": MODE_COLORS["full"],
              "eager": MODE_COLORS["eager"]}
    for j, dist in enumerate(dists):
        for i, layout in enumerate(layouts):
            pts = sorted((r["batch"], r["step_ms_median"], 100 * r["padded_waste"])
                         for r in ver if r["layout"] == layout and r["distribution"] == dist)
            b, ms, waste = zip(*pts)
            color = colors.get(layout, PALETTE[i % len(PALETTE)])
            axes[0][j].plot(b, ms, marker="o", color=color, label=layout)
            axes[1][j].plot(b, waste, marker="s", color=color, label=layout)
        batches = sorted({r["batch"] for r in ver})
        for ax in (axes[0][j], axes[1][j]):
            if len(batches) > 1:
                ax.set_xscale("log", base=2)
            ax.set_xticks(batches, [str(x) for x in batches])
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
        k = ver[0]["k"]
        axes[0][j].set_title(f"{dist} draft lengths (K={k})")
        axes[0][j].set_ylabel("verify step, median ms")
        axes[1][j].set_ylabel("padded waste, % of tokens run")
        axes[1][j].set_xlabel("batch (decoding requests)")
    fig.suptitle(title or "Verify step by layout")
    return _save(fig, path)


def spec_acceptance(rows: Sequence[dict[str, Any]], path: str | Path, title: str = "") -> str:
    """``bench spec`` (b): speedup over plain decoding against the per-token acceptance
    rate, one line per configuration (fixed K, adaptive), one panel per batch size."""
    acc = [r for r in rows if r["part"] == "acceptance" and r.get("p") is not None
           and r.get("speedup")]
    batches = sorted({r["batch"] for r in acc})
    fig = Figure(figsize=(5.5 * len(batches), 4.5))
    axes = fig.subplots(1, len(batches), squeeze=False)[0]
    for ax, bs in zip(axes, batches):
        for i, cfg in enumerate(dict.fromkeys(r["config"] for r in acc)):
            pts = sorted((r["p"], r["speedup"]) for r in acc
                         if r["config"] == cfg and r["batch"] == bs)
            if pts:
                ax.plot(*zip(*pts), marker="o", color=PALETTE[i % len(PALETTE)]
                        if not cfg.startswith("adaptive") else "#d62728", label=cfg)
        ax.axhline(1.0, color="#7f7f7f", linestyle="--", linewidth=1, label="plain")
        ax.set_xlabel("per-token acceptance p (controlled drafter)")
        ax.set_ylabel("tok/s ÷ plain tok/s")
        ax.set_title(f"batch {bs}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title or "Speedup against acceptance")
    return _save(fig, path)


def spec_drafters(rows: Sequence[dict[str, Any]], path: str | Path, title: str = "") -> str:
    """``bench spec`` (c) and (d): speedup over plain decoding per drafter configuration
    (bars), grouped by batch size; each bar labelled with its acceptance rate."""
    sel = [r for r in rows if r["part"] in ("ngram", "draft") and r.get("speedup")
           and r.get("config") != "plain"]
    labels = list(dict.fromkeys(f"{r['part']} {r['config']}" for r in sel))
    batches = sorted({r["batch"] for r in sel})
    fig = Figure(figsize=(max(6, 1.6 * len(labels) * max(1, len(batches))), 4.5))
    ax = fig.add_subplot()
    width = 0.8 / max(1, len(batches))
    for j, bs in enumerate(batches):
        for i, label in enumerate(labels):
            r = next((r for r in sel if f"{r['part']} {r['config']}" == label
                      and r["batch"] == bs), None)
            if r is None:
                continue
            x = i + (j - (len(batches) - 1) / 2) * width
            ax.bar(x, r["speedup"], width, color=PALETTE[j % len(PALETTE)],
                   label=f"batch {bs}" if i == 0 else None)
            ax.annotate(f"acc {r.get('acceptance_rate', 0):.2f}", (x, r["speedup"]),
                        ha="center", va="bottom", fontsize=7)
    ax.axhline(1.0, color="#7f7f7f", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("tok/s ÷ plain tok/s")
    ax.set_title(title or "Drafters against plain decoding")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)
