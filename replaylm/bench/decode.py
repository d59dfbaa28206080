"""Decode-speed benchmark (``replaylm bench decode``), with the protocol of docs/benchmarks.md.

- batch 1: one request, a ``prompt_len``-token random prompt (32), ``new_tokens`` (256) new
  tokens, greedy, ``ignore_eos``; tok/s = new tokens ÷ wall time of the whole ``generate``
  call (prefill included); one warm-up call first; best of ``repeats`` (3).
- batched: N different random prompts of ``batched_prompt_len`` (128) tokens, ``new_tokens``
  each, all submitted at once; output tok/s = generated tokens ÷ wall; one warm-up first.

Every batch-1 figure is printed beside its floor: weight bytes ÷ 4.23 TB/s (the H200's
measured copy bandwidth) + graph nodes × 1 µs, and the share of that floor reached. For an
MoE model the weight bytes are those one token reads: its top-k experts, not all.

The harness functions (:func:`bench_batch1`, :func:`bench_batched`) take a built ``LLM`` so
other benchmarks can reuse them; :func:`run_decode_bench` builds one engine per graph mode.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import platform
import sys
import time
from typing import Any

import torch

from replaylm.config import EngineArgs
from replaylm.sampling_params import SamplingParams

# Measured on the H200 (docs/benchmarks.md): device-to-device copy bandwidth and the replay
# cost of one graph node.
COPY_BANDWIDTH_BYTES_S = 4.23e12
GRAPH_NODE_S = 1e-6


@dataclasses.dataclass
class DecodeRow:
    """One measured configuration (one table row, one JSON record)."""

    mode: str
    batch: int
    prompt_len: int
    new_tokens: int
    generated_tokens: int
    wall_s: float
    tok_s: float
    ms_per_token: float
    all_wall_s: list[float]
    profile: dict[str, Any] | None = None  # with --profile: the per-step summary
    floor_ms: float | None = None
    floor_share: float | None = None
    graph_nodes: int | None = None
    weight_bytes: int | None = None
    graphs: dict[str, Any] | None = None  # the engine's graph stats after this run

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def random_prompts(n: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """``n`` different token-id prompts drawn from a seeded RNG, independent of the device."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (n, length), generator=gen).tolist()


def prompt_seed(seed: int, batch: int, repeat: int | None) -> int:
    """Seed of the prompts of timed ``repeat`` (``None``: the warm-up) of the batch-``batch``
    row. Every (row, repeat) and every warm-up draws its own prompts, so no timed call finds an
    earlier call's prompt in the prefix cache (caching stays on, as in a real run)."""
    base = seed + 1000 * (batch - 1)
    return base + 1 if repeat is None else base + 2 * repeat


def greedy_params(new_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)


def _sync(llm: Any) -> None:
    device = getattr(llm, "device", None)
    if isinstance(device, torch.device) and device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_generate(llm: Any, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int]:
    """Wall seconds of one ``generate`` call and the number of tokens it generated."""
    _sync(llm)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    _sync(llm)
    wall = time.perf_counter() - start
    return wall, sum(len(o.outputs[0].token_ids) for o in outs)


def weight_bytes_of(llm: Any) -> int:
    """Weight bytes one token of the loaded model reads (all of them for a dense model);
    ``weight_bytes`` may be an int or a method of dtype."""
    wb = llm.model_config.weight_bytes
    if callable(wb):
        dtype = getattr(llm, "dtype", None)
        if not isinstance(dtype, torch.dtype):
            dtype = torch.bfloat16 if llm.device.type == "cuda" else torch.float32
        wb = wb(dtype, active=True)
    return int(wb)


def graph_nodes_of(llm: Any) -> int | None:
    """Nodes of the graph that served the most steps so far (piecewise: all its links)."""
    g = llm.graph_stats()
    if not g["hits"]:
        return None
    key = max(g["hits"], key=g["hits"].get)
    return g["nodes"].get(key)


def floor_ms(weight_bytes: int, graph_nodes: int | None) -> float:
    """Floor for one graphed batch-1 step: every weight read once, plus node replay cost."""
    seconds = weight_bytes / COPY_BANDWIDTH_BYTES_S + (graph_nodes or 0) * GRAPH_NODE_S
    return seconds * 1e3


def _mode_of(llm: Any) -> str:
    return str(getattr(llm, "graph_mode", "?"))


def _vocab_of(llm: Any) -> int:
    return int(llm.model_config.vocab_size)


def bench_batch1(
    llm: Any, prompt_len: int = 32, new_tokens: int = 256, repeats: int = 3, seed: int = 0
) -> DecodeRow:
    """Batch-1 decode: warm-up once, then best of ``repeats`` whole ``generate`` calls."""
    params = greedy_params(new_tokens)
    vocab = _vocab_of(llm)
    # Different prompts for the warm-up and every timed run (``prompt_seed``), so no prefix
    # reuse can flatter the numbers.
    timed_generate(llm, random_prompts(1, prompt_len, vocab, prompt_seed(seed, 1, None)), params)
    runs = [timed_generate(llm, random_prompts(1, prompt_len, vocab, prompt_seed(seed, 1, r)),
                           params) for r in range(max(1, repeats))]
    walls = [w for w, _ in runs]
    best = min(range(len(runs)), key=lambda i: walls[i])
    wall, generated = runs[best]
    ms_per_token = wall / generated * 1e3
    wbytes = weight_bytes_of(llm)
    nodes = graph_nodes_of(llm)
    fl = floor_ms(wbytes, nodes)
    return DecodeRow(
        mode=_mode_of(llm), batch=1, prompt_len=prompt_len, new_tokens=new_tokens,
        generated_tokens=generated, wall_s=wall, tok_s=generated / wall,
        ms_per_token=ms_per_token, all_wall_s=walls, floor_ms=fl,
        floor_share=fl / ms_per_token, graph_nodes=nodes, weight_bytes=wbytes,
    )


def bench_batched(
    llm: Any, batch_size: int, prompt_len: int = 128, new_tokens: int = 256,
    repeats: int = 1, seed: int = 0,
) -> DecodeRow:
    """``batch_size`` different prompts submitted at once; output tok/s = generated ÷ wall.

    ``ms_per_token`` here is wall ÷ ``new_tokens``: the time per output token of one request.
    """
    params = greedy_params(new_tokens)
    vocab = _vocab_of(llm)
    timed_generate(llm, random_prompts(batch_size, prompt_len, vocab,
                                       prompt_seed(seed, batch_size, None)), params)
    runs = [timed_generate(llm, random_prompts(batch_size, prompt_len, vocab,
                                               prompt_seed(seed, batch_size, r)), params)
            for r in range(max(1, repeats))]
    walls = [w for w, _ in runs]
    best = min(range(len(runs)), key=lambda i: walls[i])
    wall, generated = runs[best]
    return DecodeRow(
        mode=_mode_of(llm), batch=batch_size, prompt_len=prompt_len, new_tokens=new_tokens,
        generated_tokens=generated, wall_s=wall, tok_s=generated / wall,
        ms_per_token=wall / new_tokens * 1e3, all_wall_s=walls,
        graph_nodes=graph_nodes_of(llm), weight_bytes=weight_bytes_of(llm),
    )


def engine_args_for_mode(base: EngineArgs, mode: str | None) -> EngineArgs:
    """``eager`` means ``enforce_eager``; ``None`` keeps the engine's default mode."""
    if mode is None:
        return base
    if mode == "eager":
        return base.replace(enforce_eager=True, cuda_graph_mode="eager")
    return base.replace(enforce_eager=False, cuda_graph_mode=mode)


def release_memory() -> None:
    """Collect the dropped engine and return its GPU memory before the next one is built.
    The caller must have deleted its own reference first."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_decode_bench(
    base: EngineArgs,
    modes: list[str | None],
    batch_sizes: list[int],
    prompt_len: int = 32,
    batched_prompt_len: int = 128,
    new_tokens: int = 256,
    repeats: int = 3,
    seed: int = 0,
    log: Any = print,
    profile_dir: str | None = None,
) -> tuple[list[DecodeRow], str]:
    """Run every (mode, batch size); returns the rows and the device name.

    With ``profile_dir``, each row is followed by a profiled run of the same prompts (per-step
    CPU time, GPU busy/idle, graph nodes; JSON) and a short traced one (Chrome trace).
    """
    from replaylm import LLM

    rows: list[DecodeRow] = []
    device_name = "?"
    for mode in modes:
        args = engine_args_for_mode(base, mode)
        start = time.perf_counter()
        llm = LLM.from_engine_args(args)
        g = llm.graph_stats()
        log(f"[bench] mode={llm.graph_mode} engine ready in {time.perf_counter() - start:.1f} s "
            f"on {llm.device}; captured {g['num_graphs']} graphs in {g['capture_seconds']} s, "
            f"{g['graph_mib']} MiB; kernel tuning {llm.engine.runner.tune_seconds:.1f} s")
        device_name = device_name_of(llm.device)
        for bs in batch_sizes:
            if bs == 1:
                row = bench_batch1(llm, prompt_len, new_tokens, repeats, seed)
            else:
                # Batched runs take one timed call: the protocol has no best-of for them.
                row = bench_batched(llm, bs, batched_prompt_len, new_tokens, 1, seed)
            log(f"[bench] mode={row.mode} batch={bs}: {row.tok_s:,.1f} tok/s")
            row.graphs = llm.graph_stats()
            if profile_dir is not None:
                row.profile = _profile_row(llm, row, profile_dir, prompt_len if bs == 1
                                           else batched_prompt_len, seed, log)
            rows.append(row)
        del llm
        release_memory()
    return rows, device_name


def _profile_row(llm: Any, row: DecodeRow, out_dir: str, prompt_len: int, seed: int,
                 log: Any) -> dict[str, Any]:
    from pathlib import Path

    from replaylm.bench.profile import format_summary, profile_run

    Path(out_dir).mkdir(parents=True, exist_ok=True)
    stem = f"{out_dir}/{row.mode}_b{row.batch}"
    prompts = random_prompts(row.batch, prompt_len, _vocab_of(llm),
                             prompt_seed(seed, row.batch, 0))
    result = profile_run(llm, prompts, greedy_params(row.new_tokens),
                         trace_path=f"{stem}.trace.json")
    with open(f"{stem}.steps.json", "w") as f:
        json.dump(result, f, indent=1)
    log(format_summary(f"mode={row.mode} batch={row.batch}", result["summary"],
                       result.get("trace_gpu_busy_share")))
    for name, us, launches in result.get("top_kernels_us_per_token", [])[:10]:
        log(f"[profile]   {us:8.2f} us/token  {launches:6.2f}x  {name}")
    for name, us, launches in result.get("chain_share_us_per_token", [])[:10]:
        log(f"[profile]   adds {us:8.2f} us/token  {launches:6.2f}x  {name}")
    return {"summary": result["summary"], "trace": result.get("trace"),
            "trace_gpu_busy_share": result.get("trace_gpu_busy_share")}


def device_name_of(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()})"


def format_table(rows: list[DecodeRow]) -> str:
    """Plain-text table; batch-1 rows carry the floor and the share of it reached."""
    head = f"{'mode':<20} {'batch':>5} {'tok/s':>12} {'ms/token':>10}  floor (H200)"
    lines = [head, "-" * len(head)]
    for r in rows:
        if r.batch == 1 and r.floor_ms is not None:
            nodes = (f"+ {r.graph_nodes} graph nodes" if r.graph_nodes
                     else "+ graph nodes n/a")
            floor = f"{r.floor_ms:.3f} ms ({nodes}); share {100 * (r.floor_share or 0):.1f}%"
        else:
            floor = "-"
        lines.append(f"{r.mode:<20} {r.batch:>5} {r.tok_s:>12,.1f} {r.ms_per_token:>10.3f}  {floor}")
    lines.append("tok/s: batch 1 = new tokens ÷ wall of generate (prefill included), best of "
                 "repeats; batch N = generated tokens ÷ wall. ms/token: per request.")
    lines.append("floor = weight bytes ÷ 4.23 TB/s + graph nodes × 1 µs; share = floor ÷ "
                 "measured ms/token.")
    return "\n".join(lines)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Benchmark flags plus every engine flag. ``--load-format`` defaults to dummy for named
    shapes (and the built-in default) and to auto for a model directory."""
    parser.add_argument("--batch-sizes", type=_int_list, default=[1, 256],
                        help="comma-separated batch sizes (default: 1,256)")
    parser.add_argument("--prompt-len", type=int, default=32,
                        help="batch-1 prompt length in tokens (default: 32)")
    parser.add_argument("--batched-prompt-len", type=int, default=128,
                        help="prompt length of batched runs (default: 128)")
    parser.add_argument("--new-tokens", type=int, default=256,
                        help="new tokens per request (default: 256)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="batch-1 timed calls after the warm-up; best is kept (default: 3)")
    parser.add_argument("--modes", type=str, default=None,
                        help="comma-separated graph modes, e.g. eager,full,piecewise "
                        "(default: the engine's default mode)")
    parser.add_argument("--bench-seed", type=int, default=0,
                        help="seed of the random token-id prompts (default: 0)")
    parser.add_argument("--profile", metavar="DIR", default=None,
                        help="after each row, profile one more run: per-step CPU time, GPU "
                        "busy/idle time and graph nodes (DIR/MODE_bN.steps.json) and a "
                        "Chrome/Perfetto trace of a short run (DIR/MODE_bN.trace.json)")
    parser.add_argument("--json", metavar="OUT", default=None,
                        help="write all rows, the command line, torch version and device here")
    EngineArgs.add_cli_args(parser, load_format=None, skip_tokenizer_init=True)
    return parser


def run_cli(ns: argparse.Namespace, argv: list[str] | None = None) -> int:
    """Entry point of ``replaylm bench decode``."""
    from replaylm.config import GRAPH_MODES
    from replaylm.model.shapes import resolve_model

    directory, _ = resolve_model(ns.model)
    if ns.load_format is None:
        named = directory is None or ns.model == "default"
        ns.load_format = "dummy" if named else "auto"
    if max(ns.batch_sizes) > ns.max_num_seqs:
        ns.max_num_seqs = max(ns.batch_sizes)
    base = EngineArgs.from_cli_args(ns)
    modes: list[str | None] = [None]
    if ns.modes:
        modes = [m.strip() for m in ns.modes.split(",") if m.strip()]
        bad = [m for m in modes if m not in GRAPH_MODES]
        if bad:
            print(f"error: unknown mode(s) {bad}; choose from {list(GRAPH_MODES)}", file=sys.stderr)
            return 2
    rows, device = run_decode_bench(
        base, modes, ns.batch_sizes, ns.prompt_len, ns.batched_prompt_len, ns.new_tokens,
        ns.repeats, ns.bench_seed, profile_dir=ns.profile,
    )
    print(f"model {ns.model} on {device}, torch {torch.__version__}")
    print(format_table(rows))
    if ns.json:
        record = {
            "command": "replaylm " + " ".join(sys.argv[1:] if argv is None else argv),
            "torch": torch.__version__,
            "device": device,
            "model": ns.model,
            "engine_args": dataclasses.asdict(base),
            "rows": [r.as_dict() for r in rows],
        }
        with open(ns.json, "w") as f:
            json.dump(record, f, indent=2)
        print(f"wrote {ns.json}")
    return 0
