"""``bench decode --profile``: one more run of a measured row's prompts, profiled (per-step
CPU time, GPU busy/idle, graph nodes: ``DIR/MODE_bN.steps.json``) and traced (a Chrome
trace, ``DIR/MODE_bN.trace.json``, and one steady step of it as a timeline), with its
summary logged."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from replaylm.bench.profile import format_summary, profile_run
from replaylm.sampling_params import SamplingParams


def profile_row(llm: Any, mode: str, batch: int, prompts: list[list[int]],
                params: SamplingParams, out_dir: str, log: Any) -> dict[str, Any]:
    """Profile ``prompts`` (the row of ``mode`` at ``batch``) on ``llm``; returns the row's
    ``profile``: the summary, the trace's path and GPU busy share, and the step timeline."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    stem = f"{out_dir}/{mode}_b{batch}"
    result = profile_run(llm, prompts, params, trace_path=f"{stem}.trace.json")
    with open(f"{stem}.steps.json", "w") as f:
        json.dump(result, f, indent=1)
    log(format_summary(f"mode={mode} batch={batch}", result["summary"],
                       result.get("trace_gpu_busy_share")))
    for name, us, launches in result.get("top_kernels_us_per_token", [])[:10]:
        log(f"[profile]   {us:8.2f} us/token  {launches:6.2f}x  {name}")
    for name, us, launches, gbs in result.get("chain_share_us_per_token", [])[:10]:
        bandwidth = "" if gbs is None else f"  {gbs:7.1f} GB/s"
        log(f"[profile]   adds {us:8.2f} us/token  {launches:6.2f}x{bandwidth}  {name}")
    tl = result.get("timeline")
    if tl:
        log(f"[profile]   one step: {tl['kernels']} {'kernels' if tl['source'] == 'device' else 'host ops'} "
            f"in {tl['window_us']:.1f} us, gaps {100 * tl['gap_share']:.1f}%")
    return {"summary": result["summary"], "trace": result.get("trace"),
            "trace_gpu_busy_share": result.get("trace_gpu_busy_share"), "timeline": tl}
