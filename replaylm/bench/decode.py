"""Decode-speed benchmark (``replaylm bench decode``), with the protocol of docs/benchmarks.md.

- batch 1: one request, a ``prompt_len``-token random prompt (32), ``new_tokens`` (256) new
  tokens, greedy, ``ignore_eos``; tok/s = new tokens ÷ wall time of the whole ``generate``
  call (prefill included); one warm-up call first; best of ``repeats`` (3).
- batched (N > 1): random prompts of ``batched_prompt_len`` (128) tokens, ``new_tokens`` each,
  N at a time: each finished request is replaced by the next (``bench.steady``) until a
  repeat's ``batched_requests`` have run, by default enough whole waves of N for
  ``min_seconds`` (5) of work; one warm-up wave first; output tok/s = generated tokens ÷
  wall; the median of ``batched_repeats`` (5) repeats, with their min, max and quartiles,
  the step-time p50/p99 over every repeat, and what the slowest 1% of steps coincide with.

Every batch-1 figure is printed beside its floor: weight bytes ÷ 4.23 TB/s (the H200's
measured copy bandwidth) + graph nodes × 1 µs, and the share of that floor reached. For an
MoE model the weight bytes are those one token reads: its top-k experts, not all.

The harness functions (:func:`bench_batch1`, :func:`bench_batched`) take a built ``LLM`` so
other benchmarks can reuse them; :func:`run_decode_bench` builds one engine per graph mode.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from replaylm.bench.common import (
    add_modes_arg,
    command_line,
    device_name_of,
    draw,
    each_engine,
    graph_summary,
    int_list,
    padding_between,
    parse_modes,
    percentile,
    png_path,
    random_prompts,
    resolve_model_defaults,
    write_json,
)
from replaylm.bench.decode_profile import profile_row
from replaylm.bench.floor import floor_ms, graph_nodes_of, weight_bytes_of
from replaylm.bench.observer import StepClock, observing
from replaylm.bench.peer_hf import HF_MODES, format_peers, parse_hf_modes, ratios, run_hf_peer
from replaylm.bench.steady import requests_for, spread, sync_device, tail_attribution, timed_repeats
from replaylm.config import EngineArgs
from replaylm.sampling_params import SamplingParams


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
    padding_share: float | None = None  # padded share of the tokens graphs ran in this row
    step_ms_p50: float | None = None  # time between step() returns (batched: every repeat)
    step_ms_p99: float | None = None
    # Batched rows: requests per repeat, N at a time; tok/s of every repeat and their spread
    # (median, min, max, q1, q3, (max - min) / median); the slowest steps' attribution
    # (``steady.tail_attribution``); the median repeat's per-step samples.
    requests: int | None = None
    all_tok_s: list[float] | None = None
    tok_s_spread: dict[str, float] | None = None
    tail: dict[str, Any] | None = None
    steps: list[dict[str, Any]] | None = None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def prompt_seed(seed: int, batch: int, repeat: int | None) -> int:
    """Seed of the prompts of timed ``repeat`` (``None``: the warm-up) of the batch-``batch``
    row. Every (row, repeat) and every warm-up draws its own prompts, so no timed call finds an
    earlier call's prompt in the prefix cache (caching stays on, as in a real run)."""
    base = seed + 1000 * (batch - 1)
    return base + 1 if repeat is None else base + 2 * repeat


def greedy_params(new_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)


def timed_generate(llm: Any, prompts: list[list[int]], params: SamplingParams,
                   clock: StepClock | None = None) -> tuple[float, int]:
    """Wall seconds of one ``generate`` call and the number of tokens it generated; with
    ``clock``, the return of every step of the call is noted on it."""
    sync_device(llm)
    start = time.perf_counter()
    with observing(llm.engine, clock):
        outs = llm.generate(prompts, params, use_tqdm=False)
    sync_device(llm)
    wall = time.perf_counter() - start
    return wall, sum(len(o.outputs[0].token_ids) for o in outs)


def _timed_runs(llm: Any, prompts: Callable[[int], list[list[int]]], params: SamplingParams,
                repeats: int) -> tuple[list[float], float, int, list[float]]:
    """``repeats`` timed calls, repeat ``r`` on ``prompts(r)``: every wall, the best's wall,
    tokens and step intervals (ms)."""
    runs = []
    for r in range(max(1, repeats)):
        clock = StepClock()
        wall, generated = timed_generate(llm, prompts(r), params, clock)
        runs.append((wall, generated, clock.intervals_ms()))
    wall, generated, steps = min(runs, key=lambda r: r[0])
    return [r[0] for r in runs], wall, generated, steps


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

    def prompts(repeat: int | None) -> list[list[int]]:
        # The warm-up and every timed run draw their own prompts (``prompt_seed``), so no
        # prefix reuse can flatter the numbers.
        return random_prompts(1, prompt_len, vocab, prompt_seed(seed, 1, repeat))

    timed_generate(llm, prompts(None), params)
    walls, wall, generated, steps = _timed_runs(llm, prompts, params, repeats)
    ms_per_token = wall / generated * 1e3
    wbytes = weight_bytes_of(llm)
    nodes = graph_nodes_of(llm)
    fl = floor_ms(wbytes, nodes)
    return DecodeRow(
        mode=_mode_of(llm), batch=1, prompt_len=prompt_len, new_tokens=new_tokens,
        generated_tokens=generated, wall_s=wall, tok_s=generated / wall,
        ms_per_token=ms_per_token, all_wall_s=walls, floor_ms=fl,
        floor_share=fl / ms_per_token, graph_nodes=nodes, weight_bytes=wbytes,
        step_ms_p50=percentile(steps, 50), step_ms_p99=percentile(steps, 99),
    )


def bench_batched(
    llm: Any, batch_size: int, prompt_len: int = 128, new_tokens: int = 256,
    repeats: int = 5, seed: int = 0, requests: int | None = None, min_seconds: float = 5.0,
) -> DecodeRow:
    """``batch_size`` requests at a time, ``requests`` per repeat (default: whole waves for
    ``min_seconds`` of work); ``tok_s`` is the median repeat's generated tokens ÷ wall.

    ``ms_per_token`` here is the median step time: the time per output token of one request.
    """
    params = greedy_params(new_tokens)
    vocab = _vocab_of(llm)
    count = requests

    def prompts(repeat: int | None) -> list[list[int]]:
        n = batch_size if repeat is None else count
        return random_prompts(n, prompt_len, vocab, prompt_seed(seed, batch_size, repeat))

    warm = timed_repeats(llm, lambda _: prompts(None), params, batch_size, 1)[0]
    if count is None:
        steps = [x.ms for x in warm[2] if not x.prefill_tokens] or [x.ms for x in warm[2]]
        count = requests_for(min_seconds, percentile(steps, 50) or 1.0, batch_size, new_tokens)
    runs = timed_repeats(llm, prompts, params, batch_size, repeats)
    tok_s = [g / w for w, g, _ in runs]
    middle = sorted(range(len(runs)), key=lambda i: tok_s[i])[(len(runs) - 1) // 2]
    wall, generated, samples = runs[middle]
    every = [x for _, _, smp in runs for x in smp]
    intervals = [x.ms for x in every]
    return DecodeRow(
        mode=_mode_of(llm), batch=batch_size, prompt_len=prompt_len, new_tokens=new_tokens,
        generated_tokens=generated, wall_s=wall, tok_s=generated / wall,
        ms_per_token=percentile(intervals, 50) or 0.0, all_wall_s=[w for w, _, _ in runs],
        graph_nodes=graph_nodes_of(llm), weight_bytes=weight_bytes_of(llm),
        step_ms_p50=percentile(intervals, 50), step_ms_p99=percentile(intervals, 99),
        requests=count, all_tok_s=[round(t, 3) for t in tok_s],
        tok_s_spread=spread(tok_s),
        tail=tail_attribution(every), steps=[dataclasses.asdict(x) for x in samples],
    )


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
    batched_repeats: int = 5,
    batched_requests: int | None = None,
    min_seconds: float = 5.0,
) -> tuple[list[DecodeRow], str]:
    """Run every (mode, batch size); returns the rows and the device name. Batched rows take
    ``batched_repeats``, ``batched_requests`` and ``min_seconds`` (``bench_batched``).

    With ``profile_dir``, each row is followed by a profiled run of the same prompts (per-step
    CPU time, GPU busy/idle, graph nodes; JSON) and a short traced one (Chrome trace, and one
    steady step of it as a timeline), and ``DIR/timeline_bN.png`` draws each batch size's
    step of every mode, one above the other.
    """
    rows: list[DecodeRow] = []
    device_name = "?"
    for llm, _ in each_engine(base, modes, log):
        device_name = device_name_of(llm.device)
        for bs in batch_sizes:
            before = llm.graph_stats()
            if bs == 1:
                row = bench_batch1(llm, prompt_len, new_tokens, repeats, seed)
            else:
                row = bench_batched(llm, bs, batched_prompt_len, new_tokens, batched_repeats,
                                    seed, batched_requests, min_seconds)
            log(f"[bench] mode={row.mode} batch={bs}: {row.tok_s:,.1f} tok/s")
            row.graphs = llm.graph_stats()
            row.padding_share = padding_between(before, row.graphs)
            if profile_dir is not None:
                length = prompt_len if bs == 1 else batched_prompt_len
                prompts = random_prompts(bs, length, _vocab_of(llm), prompt_seed(seed, bs, 0))
                row.profile = profile_row(llm, row.mode, bs, prompts,
                                          greedy_params(row.new_tokens), profile_dir, log)
            rows.append(row)
    if profile_dir is not None:
        draw([("step_timeline", (tls, f"{profile_dir}/timeline_b{bs}.png",
                                 f"One decode step at batch {bs} ({device_name})"))
              for bs, tls in _timelines_by_batch(rows).items()])
    return rows, device_name


def _timelines_by_batch(rows: list[DecodeRow]) -> dict[int, list[dict[str, Any]]]:
    """Each batch size's profiled step timelines, eager first."""
    out: dict[int, list[dict[str, Any]]] = {}
    for r in sorted(rows, key=lambda r: r.mode != "eager"):
        tl = (r.profile or {}).get("timeline")
        if tl and tl["spans"]:
            out.setdefault(r.batch, []).append(tl)
    return out


def format_table(rows: list[DecodeRow]) -> str:
    """Plain-text table; batch-1 rows carry the floor and the share of it reached, batched
    rows their repeats' spread and what their slowest steps coincide with."""
    head = (f"{'mode':<20} {'batch':>5} {'tok/s':>12} {'spread':>7} {'ms/token':>10} "
            f"{'p50 step ms':>11} {'p99 step ms':>11} {'padding':>8}  floor (H200)")
    lines = [head, "-" * len(head)]
    for r in rows:
        if r.batch == 1 and r.floor_ms is not None:
            nodes = (f"+ {r.graph_nodes} graph nodes" if r.graph_nodes
                     else "+ graph nodes n/a")
            floor = f"{r.floor_ms:.3f} ms ({nodes}); share {100 * (r.floor_share or 0):.1f}%"
        else:
            floor = "-"
        p50 = f"{r.step_ms_p50:.3f}" if r.step_ms_p50 is not None else "-"
        p99 = f"{r.step_ms_p99:.3f}" if r.step_ms_p99 is not None else "-"
        sp = f"{100 * r.tok_s_spread['spread']:.1f}%" if r.tok_s_spread else "-"
        lines.append(f"{r.mode:<20} {r.batch:>5} {r.tok_s:>12,.1f} {sp:>7} "
                     f"{r.ms_per_token:>10.3f} {p50:>11} {p99:>11} "
                     f"{100 * (r.padding_share or 0):>7.1f}%  {floor}")
    for r in rows:
        if r.tok_s_spread and r.tail:
            t, sp = r.tail, r.tok_s_spread
            lines.append(
                f"{r.mode} batch {r.batch}: {r.requests} requests per repeat, "
                f"{len(r.all_tok_s or [])} repeats, tok/s min {sp['min']:,.0f} q1 {sp['q1']:,.0f} "
                f"median {sp['median']:,.0f} q3 {sp['q3']:,.0f} max {sp['max']:,.0f}; "
                f"slowest {t['steps']} steps (>= {t['threshold_ms']:.2f} ms): prefill "
                f"{t['prefill']}, gc {t['gc']}, host {t['host']}, other {t['other']}; "
                f"decode-only steps p50 {t['decode_only_p50_ms']} p99 {t['decode_only_p99_ms']} "
                f"ms; {t['prefill_steps']} steps with prefill")
    lines.append("tok/s: batch 1 = new tokens ÷ wall of generate (prefill included), best of "
                 "repeats; batch N = generated tokens ÷ wall with N requests at a time, median "
                 "of repeats; spread = (max - min) ÷ median. ms/token: per request.")
    lines.append("p50/p99 step ms: percentiles of the time between step() returns (one token "
                 "per running request each); padding: padded share of the tokens graphs ran.")
    lines.append("floor = weight bytes ÷ 4.23 TB/s + graph nodes × 1 µs; share = floor ÷ "
                 "measured ms/token.")
    return "\n".join(lines)


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Benchmark flags plus every engine flag. ``--load-format`` defaults to dummy for named
    shapes (and the built-in default) and to auto for a model directory."""
    parser.add_argument("--batch-sizes", type=int_list, default=[1, 256],
                        help="comma-separated batch sizes (default: 1,256)")
    parser.add_argument("--prompt-len", type=int, default=32,
                        help="batch-1 prompt length in tokens (default: 32)")
    parser.add_argument("--batched-prompt-len", type=int, default=128,
                        help="prompt length of batched runs (default: 128)")
    parser.add_argument("--new-tokens", type=int, default=256,
                        help="new tokens per request (default: 256)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="batch-1 timed calls after the warm-up; best is kept (default: 3)")
    parser.add_argument("--batched-repeats", type=int, default=5,
                        help="timed repeats of each batched row; the median is reported with "
                        "its spread (default: 5)")
    parser.add_argument("--batched-requests", type=int, default=None,
                        help="requests per batched repeat, N at a time (default: whole waves "
                        "of N for --min-seconds of work, from the warm-up's step time)")
    parser.add_argument("--min-seconds", type=float, default=5.0,
                        help="work per batched repeat when --batched-requests is not given "
                        "(default: 5)")
    add_modes_arg(parser)
    parser.add_argument("--bench-seed", type=int, default=0,
                        help="seed of the random token-id prompts (default: 0)")
    parser.add_argument("--profile", metavar="DIR", default=None,
                        help="after each row, profile one more run: per-step CPU time, GPU "
                        "busy/idle time and graph nodes (DIR/MODE_bN.steps.json), a "
                        "Chrome/Perfetto trace of a short run (DIR/MODE_bN.trace.json) and one "
                        "step of it drawn per batch size, every mode one above the other "
                        "(DIR/timeline_bN.png)")
    parser.add_argument("--peer", choices=["hf"], default=None,
                        help="also run Hugging Face transformers on the same checkpoint, "
                        "prompts and protocol, and print replaylm's ratio against it")
    parser.add_argument("--peer-hf-modes", default=",".join(HF_MODES),
                        help="transformers modes for --peer hf (default: all of "
                        f"{','.join(HF_MODES)})")
    parser.add_argument("--json", metavar="OUT", default=None,
                        help="write all rows, the command line, torch version and device here, "
                        "and PNG plots next to it (OUT stem + _throughput, _padding, _capture)")
    EngineArgs.add_cli_args(parser, load_format=None, skip_tokenizer_init=True)
    return parser


def run_cli(ns: argparse.Namespace, argv: list[str] | None = None) -> int:
    """Entry point of ``replaylm bench decode``."""
    resolve_model_defaults(ns)
    if max(ns.batch_sizes) > ns.max_num_seqs:
        ns.max_num_seqs = max(ns.batch_sizes)
    base = EngineArgs.from_cli_args(ns)
    try:
        if ns.batched_repeats < 1 or (ns.batched_requests is not None
                                      and ns.batched_requests < 1) or ns.min_seconds < 0:
            raise ValueError("--batched-repeats and --batched-requests must be >= 1, "
                             "--min-seconds >= 0")
        modes = parse_modes(ns.modes)
        hf_modes = parse_hf_modes(ns.peer_hf_modes) if ns.peer else []
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows, device = run_decode_bench(
        base, modes, ns.batch_sizes, ns.prompt_len, ns.batched_prompt_len, ns.new_tokens,
        ns.repeats, ns.bench_seed, profile_dir=ns.profile, batched_repeats=ns.batched_repeats,
        batched_requests=ns.batched_requests, min_seconds=ns.min_seconds,
    )
    row_dicts = [r.as_dict() for r in rows]
    peers = [p.as_dict() for p in run_hf_peer(
        base, hf_modes, ns.batch_sizes, ns.prompt_len, ns.batched_prompt_len, ns.new_tokens,
        ns.repeats, ns.bench_seed)] if hf_modes else []
    ratio_rows = ratios(row_dicts, peers)
    print(f"model {ns.model} on {device}, torch {torch.__version__}")
    print(format_table(rows))
    if peers:
        print(format_peers(peers, ratio_rows))
    if ns.json:
        write_json(ns.json, {
            "command": command_line(argv),
            "torch": torch.__version__,
            "device": device,
            "model": ns.model,
            "engine_args": dataclasses.asdict(base),
            "rows": row_dicts,
            "peers": peers,
            "ratios": ratio_rows,
        })
        captures = [{"mode": r["mode"], **graph_summary(r["graphs"])} for r in
                    {r["mode"]: r for r in row_dicts}.values()]
        title = f"{ns.model} on {device}"
        draw([("decode_throughput", (row_dicts, peers, png_path(ns.json, "throughput"), title)),
              ("padding_waste", (row_dicts, png_path(ns.json, "padding"), title)),
              ("capture_cost", (captures, png_path(ns.json, "capture"), title))])
    return 0
