"""``replaylm bench serve``: replay a request trace and measure what users see.

Requests arrive as a Poisson process at each ``--request-rate(s)`` (``inf``: all at once), or
at a JSONL trace's own times; every request streams, greedy, ignoring EOS, so it produces
exactly its output length. Two targets:

- in-process (default): one engine per ``--modes`` entry, driven by the server's engine loop
  (``replaylm.server.engine_loop``: one thread steps the engine, deltas reach asyncio
  queues), with a timestamp per delta;
- ``--base-url URL``: a running OpenAI-compatible server (``replaylm serve``, vLLM, SGLang)
  through streaming ``/v1/completions`` (needs httpx), a timestamp per streamed chunk.

Metrics are defined in ``replaylm.bench.latency``. Synthetic prompts are random token ids,
different for every run, so no run is served from another's prefix cache.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import math
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import torch

from replaylm.bench.common import (
    add_modes_arg,
    command_line,
    device_name_of,
    draw,
    each_engine,
    graph_summary,
    padding_between,
    parse_modes,
    png_path,
    resolve_model_defaults,
    write_json,
)
from replaylm.bench.latency import RequestResult, format_runs, summarize
from replaylm.bench.workload import (
    LEN_DISTS,
    RequestSpec,
    fit_context,
    load_trace,
    parse_rates,
    rate_label,
    synthetic,
    with_arrivals,
)
from replaylm.config import EngineArgs

Send = Callable[[RequestSpec, RequestResult, float], Awaitable[None]]


async def replay(specs: list[RequestSpec], target: Any, desc: str = "",
                 progress: bool = True) -> list[RequestResult]:
    """Send every request to ``target`` at its arrival time (concurrently) and wait for all
    of them, inside one ``target.session()``."""
    async with target.session():
        return await _replay(specs, target.send, desc, progress)


async def _replay(specs: list[RequestSpec], send: Send, desc: str, progress: bool
                  ) -> list[RequestResult]:
    from tqdm.auto import tqdm

    bar = tqdm(total=len(specs), desc=desc, unit="req", disable=not progress)
    t0 = time.perf_counter()

    async def one(spec: RequestSpec) -> RequestResult:
        delay = t0 + spec.arrival_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        res = RequestResult(spec.index, spec.prompt_len, spec.output_len,
                            time.perf_counter() - t0)
        try:
            await send(spec, res, t0)
        except Exception as e:  # a failed request is a result, not the end of the run
            res.error = f"{type(e).__name__}: {e}"[:300]
        bar.update(1)
        return res

    try:
        return list(await asyncio.gather(*(one(s) for s in specs)))
    finally:
        bar.close()


def greedy(output_len: int) -> Any:
    from replaylm.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)


class InProcess:
    """Requests into one ``EngineCore`` through the server's engine loop."""

    def __init__(self, core: Any) -> None:
        from replaylm.server.engine_loop import EngineLoop

        self.loop = EngineLoop(core, max_queue=sys.maxsize)
        self.loop.start()
        self._ids = itertools.count()

    @asynccontextmanager
    async def session(self) -> AsyncIterator[None]:
        yield

    async def send(self, spec: RequestSpec, res: RequestResult, t0: float) -> None:
        from replaylm.server.engine_loop import EngineFailure

        queue: asyncio.Queue = asyncio.Queue()
        res.prompt_len = await self.loop.add(f"bench-{next(self._ids)}", spec.prompt,
                                             greedy(spec.output_len), queue)
        while True:
            _, d = await queue.get()
            if isinstance(d, EngineFailure):
                raise d
            now = time.perf_counter() - t0
            if d.new_token_ids:
                res.chunk_s.append(now)
                res.output_tokens += len(d.new_token_ids)
            if d.finished:
                res.finished_s = now
                if d.finish_reason == "abort":
                    res.error = "aborted"
                return

    def close(self) -> None:
        self.loop.shutdown()


class Http:
    """Streaming ``/v1/completions`` requests to a running server."""

    def __init__(self, base_url: str) -> None:
        import httpx

        self.base = base_url.rstrip("/").removesuffix("/v1")
        info = httpx.get(f"{self.base}/v1/models", timeout=30, trust_env=False).json()
        self.model_id = info["data"][0]["id"]
        self.max_model_len = info["data"][0].get("max_model_len")
        self.client: Any = None

    @asynccontextmanager
    async def session(self) -> AsyncIterator[None]:
        """One connection pool per run (each run has its own event loop)."""
        import httpx

        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(timeout=httpx.Timeout(None), trust_env=False,
                                     limits=limits) as self.client:
            yield

    async def send(self, spec: RequestSpec, res: RequestResult, t0: float) -> None:
        body = {"model": self.model_id, "prompt": spec.prompt, "max_tokens": spec.output_len,
                "temperature": 0.0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        async with self.client.stream("POST", f"{self.base}/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"])[:300]
                    return
                if any(c.get("text") for c in chunk.get("choices") or []):
                    res.chunk_s.append(time.perf_counter() - t0)
                if chunk.get("usage"):
                    res.output_tokens = int(chunk["usage"]["completion_tokens"])
                    res.prompt_len = int(chunk["usage"]["prompt_tokens"])
        res.finished_s = time.perf_counter() - t0
        if not res.output_tokens:  # a server that sends no usage: one token per chunk
            res.output_tokens = len(res.chunk_s)


@dataclasses.dataclass
class Workload:
    """How each run's requests are made (one call per run, so prompts never repeat)."""

    num_requests: int
    input_len: int
    output_len: int
    len_dist: str
    len_range_ratio: float
    trace: str | None
    seed: int

    def requests(self, run: int, rate: float | None, vocab_size: int,
                 max_model_len: int | None) -> tuple[list[RequestSpec], int]:
        """The requests of run ``run`` at ``rate`` (None: the trace's own arrival times);
        returns them and how many were shortened to fit ``max_model_len``."""
        prompt_seed = self.seed + 1000 * (run + 1)
        if self.trace is not None:
            specs = load_trace(self.trace, vocab_size, prompt_seed)[: self.num_requests]
        else:
            specs = synthetic(self.num_requests, self.input_len, self.output_len,
                              self.len_dist, self.len_range_ratio, vocab_size, self.seed,
                              prompt_seed)
        if rate is not None:
            specs = with_arrivals(specs, rate, self.seed)
        return fit_context(specs, max_model_len) if max_model_len else (specs, 0)


def run_target(target: Any, workload: Workload, rates: list[float | None], mode: str,
               vocab_size: int, max_model_len: int | None, slo: dict[str, float],
               warmup: int, progress: bool, first_run: int = 0,
               stats: Callable[[], dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Every rate against one target; returns one summary per rate."""
    if warmup:
        warm = synthetic(warmup, workload.input_len, 4, "fixed", 0.0, vocab_size, workload.seed,
                         prompt_seed=workload.seed + 999)
        warm = fit_context(warm, max_model_len)[0] if max_model_len else warm
        asyncio.run(replay(warm, target, progress=False))
    runs = []
    for i, rate in enumerate(rates):
        specs, clipped = workload.requests(first_run + i, rate, vocab_size, max_model_len)
        label = "trace" if rate is None else rate_label(rate)
        before = stats() if stats else None
        results = asyncio.run(replay(specs, target, f"{mode} rate {label}", progress))
        run = {"mode": mode, "request_rate": None if rate is None or math.isinf(rate) else rate,
               "rate_label": label, "num_requests": len(specs), "clipped": clipped,
               **summarize(results, slo)}
        if stats is not None:
            run["padding_share"] = padding_between(before, stats())
        run["requests"] = [r.as_dict() for r in results]
        runs.append(run)
    return runs


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Workload, target, SLO and output flags, plus every engine flag (in-process target)."""
    w = parser.add_argument_group("workload")
    w.add_argument("--num-requests", type=int, default=200,
                   help="requests per run (default: 200; a trace's first N)")
    w.add_argument("--request-rate", default=None,
                   help="Poisson arrivals at this many requests/s; inf = all at once "
                   "(default: inf, or a trace's own arrival times)")
    w.add_argument("--request-rates", default=None,
                   help="a sweep of rates, e.g. 1,2,4,inf: one run each")
    w.add_argument("--input-len", type=int, default=128, help="mean prompt tokens (default: 128)")
    w.add_argument("--output-len", type=int, default=128, help="mean output tokens (default: 128)")
    w.add_argument("--len-dist", choices=LEN_DISTS, default="fixed",
                   help="prompt and output lengths: fixed, uniform over mean × [1-r, 1+r], or "
                   "exponential with that mean (default: fixed)")
    w.add_argument("--len-range-ratio", type=float, default=0.5,
                   help="r of --len-dist uniform (default: 0.5)")
    w.add_argument("--trace", default=None, metavar="JSONL",
                   help="requests from a JSONL file: output_len and prompt (text or token ids) "
                   "or prompt_len, optional arrival_s")
    w.add_argument("--bench-seed", type=int, default=0,
                   help="seed of lengths, prompts and arrivals; change it between runs against "
                   "one server, whose prefix cache may hold an earlier run's prompts")
    w.add_argument("--warmup-requests", type=int, default=1,
                   help="short unmeasured requests (random prompts of --input-len tokens) "
                   "before the runs of each target (default: 1)")
    t = parser.add_argument_group("target and output")
    t.add_argument("--base-url", default=None,
                   help="a running OpenAI-compatible server, e.g. http://127.0.0.1:8000 "
                   "(default: an engine in this process per --modes)")
    add_modes_arg(t)
    t.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput: TTFT bound")
    t.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput: TPOT bound")
    t.add_argument("--slo-e2e-ms", type=float, default=None, help="goodput: end-to-end bound")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.add_argument("--json", metavar="OUT", default=None,
                   help="write every run (and every request) here, and PNG plots next to it "
                   "(OUT stem + _latency, _throughput)")
    EngineArgs.add_cli_args(parser, load_format=None, skip_tokenizer_init=None)
    return parser


def _rates(ns: argparse.Namespace) -> list[float | None]:
    if ns.request_rate is not None and ns.request_rates is not None:
        raise ValueError("give --request-rate or --request-rates, not both")
    text = ns.request_rates or ns.request_rate
    if text is None:
        return [None] if ns.trace else [math.inf]
    return list(parse_rates(text))


def run_cli(ns: argparse.Namespace, argv: list[str] | None = None) -> int:
    """Entry point of ``replaylm bench serve``."""
    from replaylm.engine.loading import load_model_config

    resolve_model_defaults(ns)
    try:
        rates = _rates(ns)
        modes = parse_modes(ns.modes)
        if ns.base_url and ns.modes:
            raise ValueError("--modes builds engines in this process; a --base-url server "
                             "runs its own mode")
        if ns.num_requests < 1:
            raise ValueError("--num-requests must be >= 1")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    slo = {k: v for k, v in (("ttft_ms", ns.slo_ttft_ms), ("tpot_ms", ns.slo_tpot_ms),
                             ("e2e_ms", ns.slo_e2e_ms)) if v is not None}
    workload = Workload(ns.num_requests, ns.input_len, ns.output_len, ns.len_dist,
                        ns.len_range_ratio, ns.trace, ns.bench_seed)
    vocab = load_model_config(ns.model)[0].vocab_size
    runs: list[dict[str, Any]] = []
    engines: dict[str, Any] = {}
    progress = not ns.no_progress
    if ns.base_url:
        try:
            target = Http(ns.base_url)
        except ImportError:
            print("bench serve --base-url needs httpx: pip install 'replaylm[bench]'",
                  file=sys.stderr)
            return 1
        except Exception as e:  # httpx's connection errors, or a reply that is not a model list
            print(f"error: no OpenAI-compatible server at {ns.base_url} "
                  f"({type(e).__name__}: {e})", file=sys.stderr)
            return 1
        device, target_name = f"server at {target.base}", target.base
        runs = run_target(target, workload, rates, target.model_id, vocab,
                          target.max_model_len, slo, ns.warmup_requests, progress)
    else:
        base = EngineArgs.from_cli_args(ns)
        device, target_name = "?", "in-process"
        for llm, ready_s in each_engine(base, modes):
            device = device_name_of(llm.device)
            engines[llm.graph_mode] = {"ready_s": round(ready_s, 3),
                                       **graph_summary(llm.graph_stats())}
            target = InProcess(llm.engine)
            try:
                runs += run_target(target, workload, rates, llm.graph_mode,
                                   llm.model_config.vocab_size, llm.engine.max_model_len, slo,
                                   ns.warmup_requests, progress, first_run=len(runs),
                                   stats=llm.graph_stats)
            finally:
                target.close()
            del target, llm
    print(f"model {ns.model}, target {target_name} on {device}")
    print(format_runs(runs))
    if ns.json:
        write_json(ns.json, {
            "command": command_line(argv), "torch": torch.__version__, "device": device,
            "model": ns.model, "target": target_name,
            "workload": dataclasses.asdict(workload), "slo": slo, "engines": engines,
            "engine_args": dataclasses.asdict(EngineArgs.from_cli_args(ns)), "runs": runs})
        title = f"{ns.model}, {target_name} ({device})"
        draw([("latency_vs_rate", (runs, png_path(ns.json, "latency"), title)),
              ("serving_throughput", (runs, png_path(ns.json, "throughput"), title))])
    return 0
