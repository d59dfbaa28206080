"""``replaylm`` subcommands: ``generate``, ``demo``, ``serve`` and
``bench decode|serve|spec|startup``.

Engine flags come from :meth:`EngineArgs.add_cli_args`, so every command spells them as
``LLM(...)`` does. The engine is imported only when a command runs, so ``--help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from collections.abc import Callable
from typing import Any

from replaylm.config import EngineArgs

Handler = Callable[[argparse.Namespace, "list[str] | None"], int]

DEMO_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "CUDA graphs remove launch overhead because",
    "Once upon a time,",
]


def _add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    parser.add_argument("--max-tokens", type=int, default=max_tokens,
                        help=f"new tokens to generate at most (default: {max_tokens})")
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="0 = greedy (default: 1.0)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus filter (default: 1.0)")
    parser.add_argument("--top-k", type=int, default=-1, help="-1 = off (default: -1)")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="keep generating past end-of-sequence tokens")


def _sampling_params(ns: argparse.Namespace) -> Any:
    from replaylm.sampling_params import SamplingParams

    # The engine's --seed doubles as the request seed, so one flag makes a run reproducible.
    return SamplingParams(
        temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k, seed=ns.seed,
        max_tokens=ns.max_tokens, ignore_eos=ns.ignore_eos,
    )


def _build_llm(ns: argparse.Namespace) -> tuple[Any, float]:
    from replaylm import LLM

    start = time.perf_counter()
    llm = LLM.from_engine_args(EngineArgs.from_cli_args(ns))
    return llm, time.perf_counter() - start


def _timed_generate(llm: Any, prompts: Any, params: Any, use_tqdm: bool) -> tuple[Any, float]:
    import torch

    cuda = llm.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(llm.device)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    if cuda:
        torch.cuda.synchronize(llm.device)
    return outs, time.perf_counter() - start


def cmd_generate(ns: argparse.Namespace, argv: list[str] | None) -> int:
    """Generate one completion and print its text (or a JSON record)."""
    llm, load_s = _build_llm(ns)
    outs, wall = _timed_generate(llm, [ns.prompt], _sampling_params(ns), use_tqdm=False)
    out = outs[0]
    completion = out.outputs[0]
    if not ns.json:
        print(completion.text)
        return 0
    n = len(completion.token_ids)
    record = {
        "model": ns.model,
        "prompt": ns.prompt,
        "prompt_token_ids": list(out.prompt_token_ids),
        "text": completion.text,
        "token_ids": list(completion.token_ids),
        "finish_reason": completion.finish_reason,
        "graph_mode": llm.graph_mode,
        "timing": {"load_s": load_s, "generate_s": wall,
                   "tok_s": n / wall if wall > 0 else None},
    }
    print(json.dumps(record, indent=2))
    return 0


def cmd_demo(ns: argparse.Namespace, argv: list[str] | None) -> int:
    """Run a few prompts on the built-in model and show text, speed and engine stats."""
    llm, load_s = _build_llm(ns)
    mc = llm.model_config
    print(f"replaylm demo: model {mc.name} ({mc.num_params / 1e6:.1f} M params, "
          f"{mc.num_layers} layers, vocab {mc.vocab_size}) on {llm.device}, "
          f"graph mode {llm.graph_mode}; engine ready in {load_s:.2f} s")
    if ns.model == "default":
        print("note: the built-in default model has random weights, so its text is gibberish; "
              "it is here to exercise the engine end to end.")
    outs, wall = _timed_generate(llm, DEMO_PROMPTS, _sampling_params(ns), use_tqdm=True)
    generated = 0
    for out in outs:
        completion = out.outputs[0]
        generated += len(completion.token_ids)
        print(f"\n>>> {out.prompt!r}\n{completion.text!r}  [{len(completion.token_ids)} tokens, "
              f"{completion.finish_reason}]")
    print(f"\n{generated} tokens for {len(outs)} requests in {wall:.3f} s: "
          f"{generated / wall:,.1f} tok/s")
    print("engine stats:")
    for key, value in llm.stats().as_dict().items():
        print(f"  {key}: {value}")
    return 0


def cmd_serve(ns: argparse.Namespace, argv: list[str] | None) -> int:
    from replaylm.server.serve import run_cli

    return run_cli(ns, argv)


BENCHES: dict[str, tuple[str, str]] = {
    "decode": ("batch-1 and batched decode tok/s per graph mode",
               "Decode tok/s per graph mode, with the batch-1 bandwidth floor."),
    "serve": ("replay a request trace: TTFT, TPOT, ITL, end-to-end latency, goodput",
              "Replay requests (Poisson arrivals at one or more rates, or a JSONL trace) "
              "against engines in this process or a running server (--base-url); report "
              "latency percentiles, throughput and goodput under an SLO."),
    "spec": ("speculative decoding: verify layouts, speedup against acceptance, drafters",
             "Time verify steps per layout (ragged, padded, eager), measure tok/s against a "
             "controlled acceptance rate (fixed K and the adaptive budget), and run the "
             "n-gram and draft-model drafters against plain decoding."),
    "startup": ("cold and warm engine start, split into phases (seconds and MiB)",
                "Start engines in fresh processes, cold (empty caches) and warm, and split "
                "each start into weights, kernel tuning, KV sizing, capture and the rest."),
}


def _bench_command(name: str) -> Handler:
    """The handler of ``replaylm bench NAME``: ``replaylm.bench.NAME.run_cli``."""
    def run(ns: argparse.Namespace, argv: list[str] | None) -> int:
        return importlib.import_module(f"replaylm.bench.{name}").run_cli(ns, argv)
    return run


def build_parser() -> argparse.ArgumentParser:
    """The full parser; each subcommand stores its handler in ``func``."""
    parser = argparse.ArgumentParser(
        prog="replaylm", description="A CUDA-graph-centred LLM inference engine.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    gen = sub.add_parser("generate", help="generate a completion for one prompt",
                         description=cmd_generate.__doc__)
    gen.add_argument("--prompt", required=True, help="prompt text")
    _add_sampling_args(gen, max_tokens=64)
    gen.add_argument("--json", action="store_true",
                     help="print a JSON record (text, token_ids, finish_reason, timing)")
    EngineArgs.add_cli_args(gen)
    gen.set_defaults(func=cmd_generate)

    demo = sub.add_parser("demo", help="run a few prompts on the built-in default model",
                          description=cmd_demo.__doc__)
    _add_sampling_args(demo, max_tokens=32)
    EngineArgs.add_cli_args(demo)
    demo.set_defaults(func=cmd_demo)

    from replaylm.server.serve import add_cli_args as add_serve_args

    serve = sub.add_parser(
        "serve", help="OpenAI-compatible HTTP server (needs the server extra)",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and "
        "/metrics with FastAPI + uvicorn; SIGTERM drains in-flight requests and exits 0.")
    add_serve_args(serve)
    serve.set_defaults(func=cmd_serve)

    bench = sub.add_parser("bench", help="benchmarks: decode, serve, spec, startup",
                           description="Benchmarks that follow the measurement protocol of "
                           "docs/benchmarks.md.")
    bench_sub = bench.add_subparsers(dest="bench", metavar="BENCH")
    for name, (help_, description) in BENCHES.items():
        cmd = bench_sub.add_parser(name, help=help_, description=description)
        importlib.import_module(f"replaylm.bench.{name}").add_cli_args(cmd)
        cmd.set_defaults(func=_bench_command(name))
    bench.set_defaults(func=lambda ns, argv: _missing(bench))
    return parser


def _missing(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the subcommand, return its exit code."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    func: Handler | None = getattr(ns, "func", None)
    if func is None:
        return _missing(parser)
    return func(ns, argv)
