"""Speculative decoding benchmark (``replaylm bench spec``).

Four parts, each selectable (``--parts``):

- ``verify`` (a): the time of one verify step and its padded waste, per verify layout
  (``speculative_config['verify']``: ragged, padded, eager), batch size and draft-length
  distribution (``uniform``: every length in 0..K equally likely; ``skewed``: 0..2 with
  probability 0.8, else K). ``batch`` requests are brought to decoding, then every step each
  one verifies random drafts of a drawn length (random drafts are rejected: each step emits
  one token per request, so the traffic stays the same step after step). A step is timed
  from its first device operation to the last one it enqueued: CUDA events on a GPU, wall
  time on the CPU (where every operation runs synchronously).
- ``acceptance`` (b): end-to-end greedy tok/s against the acceptance rate. A plain greedy run
  records each prompt's continuation first; ``ControlledDrafter`` then drafts that
  continuation with every draft token replaced by a wrong one with probability ``1 - p``,
  and the verify accepts the drafts it left right up to the first wrong one, so on any
  weights (random ones included) each draft is accepted with probability ``p`` given the
  ones before it were. Outputs then follow the accepted drafts, not the plain run's
  (``matches_reference`` counts the requests that still equal it). Plain decoding against
  fixed K and the adaptive budget; ``--pipelines`` runs fixed K with each
  ``speculative_config['pipeline']`` setting (``speculative.pipeline``).
- ``ngram`` (c): the n-gram drafter on prompts made of a repeated span, fixed K and
  adaptive against plain (on random weights the output does not repeat the prompt, so
  acceptance is near zero: the point is what the budget does with it).
- ``draft`` (d): ``{"method": "draft_model", "model": M}`` against plain, and the target
  drafting for itself (the upper bound); an engine that refuses the configuration is
  reported with its error.

Every engine is built once (one at a time, the previous one freed) and runs every
measurement that needs it. Prefix caching is off, so repeated prompts (warm-ups) do not
flatter later runs.

This module runs the plan and holds the command; the drafters are in ``spec_drafters``, the
measurements in ``spec_measure``, the options and the plan in ``spec_plan``, the table, JSON
and plots in ``spec_report``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from replaylm.bench.common import (
    command_line,
    device_name_of,
    int_list,
    random_prompts,
    release_memory,
    resolve_model_defaults,
)
from replaylm.bench.spec_drafters import ControlledDrafter
from replaylm.bench.spec_measure import (
    e2e_run,
    generate_timed,
    repeated_span_prompts,
    verify_point,
)
from replaylm.bench.spec_plan import (
    DISTRIBUTIONS,
    LAYOUTS,
    PARTS,
    Options,
    config_of,
    engine_plan,
)
from replaylm.bench.spec_report import add_speedups, format_table, write_report
from replaylm.config import EngineArgs
from replaylm.speculative.config import PIPELINE_MODES


def run_spec_bench(base: EngineArgs, opts: Options, log: Any = print
                   ) -> tuple[list[dict[str, Any]], str]:
    """Build each engine of the plan in turn and run its measurements; returns the rows
    and the device name."""
    from replaylm import LLM

    rows: list[dict[str, Any]] = []
    device_name = "?"
    refs: dict[int, dict[tuple[int, ...], list[int]]] = {}  # batch -> prompt -> output
    vocab: int | None = None
    b_prompts: dict[int, list[list[int]]] = {}
    c_prompts: dict[int, list[list[int]]] = {}
    for label, spec, roles in engine_plan(opts, base.model):
        start = time.perf_counter()
        try:
            llm = LLM.from_engine_args(base.replace(speculative_config=spec,
                                                    enable_prefix_caching=False))
        except (ValueError, RuntimeError, OSError) as e:
            if "draft" not in roles:
                raise
            log(f"[bench spec] {label}: engine refused: {e}")
            for bs in opts.e2e_batches:
                rows.append({"part": "draft", "batch": bs, **config_of(label, spec),
                             "model": spec["model"] if spec else None, "error": str(e)})
            continue
        log(f"[bench spec] {label}: engine ready in {time.perf_counter() - start:.1f} s "
            f"(graph mode {llm.graph_mode})")
        device_name = device_name_of(llm.device)
        vocab = int(llm.model_config.vocab_size)
        for bs in opts.e2e_batches:
            b_prompts.setdefault(bs, random_prompts(bs, opts.prompt_len, vocab,
                                                    opts.seed + 7919 * bs))
            c_prompts.setdefault(bs, repeated_span_prompts(bs, opts.prompt_len, vocab,
                                                           opts.seed + 104729 * bs))
        cfg = config_of(label, spec)
        core = llm.engine
        own_drafter = core.drafter
        if "layout" in roles:
            for bs in opts.verify_batches:
                for dist in opts.distributions:
                    row = verify_point(llm, bs, dist, opts.verify_k, opts.verify_steps,
                                       opts.verify_warmup, opts.prompt_len, opts.seed)
                    log(f"[bench spec] verify layout={row['layout']} batch={bs} {dist}: "
                        f"{row['step_ms_median']:.3f} ms/step, waste "
                        f"{100 * row['padded_waste']:.1f}%")
                    rows.append(row)
            core.use_drafter(own_drafter)
        if "plain" in roles:
            for bs in opts.e2e_batches:
                if {"acceptance", "draft"} & set(opts.parts):
                    row, outs = e2e_run(llm, b_prompts[bs], opts.new_tokens, opts.warmup_tokens)
                    refs[bs] = {tuple(p): o for p, o in zip(b_prompts[bs], outs)}
                    rows.append({"part": "acceptance", "p": None, **cfg, **row})
                    log(f"[bench spec] plain batch={bs}: {row['tok_s']:,.1f} tok/s")
                if "ngram" in opts.parts:
                    row, _ = e2e_run(llm, c_prompts[bs], opts.new_tokens, opts.warmup_tokens)
                    rows.append({"part": "ngram", **cfg, **row})
        if "ngram" in roles:
            core.use_drafter(own_drafter)
            for bs in opts.e2e_batches:
                row, _ = e2e_run(llm, c_prompts[bs], opts.new_tokens, opts.warmup_tokens)
                rows.append({"part": "ngram", **cfg, **row})
                log(f"[bench spec] ngram {label} batch={bs}: {row['tok_s']:,.1f} tok/s, "
                    f"acceptance {row['acceptance_rate']:.3f}, budget "
                    f"{row['budget_tokens_per_step']:.2f}")
        if "controlled" in roles:
            for bs in opts.e2e_batches:
                for p in opts.acceptance:
                    seed = opts.seed + int(1000 * p)
                    if opts.warmup_tokens:  # its own drafter: the timed one starts afresh
                        core.use_drafter(ControlledDrafter(refs[bs], p, vocab, seed + 1))
                        generate_timed(llm, b_prompts[bs], opts.warmup_tokens)
                    drafter = ControlledDrafter(refs[bs], p, vocab, seed)
                    core.use_drafter(drafter)
                    row, outs = e2e_run(llm, b_prompts[bs], opts.new_tokens, 0)
                    row["expected_accepted_length"] = (
                        drafter.expected_accepted_length if cfg["budget"] == "fixed" else None)
                    row["diverged_requests"] = len(drafter.diverged)
                    row["matches_reference"] = sum(
                        o == refs[bs][tuple(pr)] for pr, o in zip(b_prompts[bs], outs))
                    rows.append({"part": "acceptance", "p": p, **cfg, **row})
                    log(f"[bench spec] {label} p={p} batch={bs}: {row['tok_s']:,.1f} tok/s, "
                        f"mean accepted {row['mean_accepted_length']:.2f}, budget "
                        f"{row['budget_tokens_per_step']:.2f}")
            core.use_drafter(own_drafter)
        if "draft" in roles:
            for bs in opts.e2e_batches:
                row, outs = e2e_run(llm, b_prompts[bs], opts.new_tokens, opts.warmup_tokens)
                row["matches_plain"] = (sum(o == refs[bs][tuple(pr)] for pr, o in
                                            zip(b_prompts[bs], outs)) if bs in refs else None)
                rows.append({"part": "draft", "model": spec["model"], **cfg, **row,
                             "error": None})
        del llm, core, own_drafter
        release_memory()
    add_speedups(rows)
    return rows, device_name


# CLI ----------------------------------------------------------------------------------------


def _float_list(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from e
    if not values or not all(0.0 <= v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"expected probabilities in [0, 1], got {text!r}")
    return values


def _choices(options: Sequence[str]) -> Any:
    def parse(text: str) -> list[str]:
        values = [x.strip() for x in text.split(",") if x.strip()]
        bad = [v for v in values if v not in options]
        if not values or bad:
            raise argparse.ArgumentTypeError(f"unknown {bad or text!r}: choose from "
                                             f"{list(options)}")
        return values
    return parse


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    d = Options()
    parser.add_argument("--parts", type=_choices(PARTS), default=list(PARTS),
                        help="comma-separated parts: verify (a), acceptance (b), ngram (c), "
                        "draft (d) (default: all)")
    parser.add_argument("--verify-batch-sizes", type=int_list, default=list(d.verify_batches),
                        help="(a) batch sizes (default: 1,4,16,64)")
    parser.add_argument("--distributions", type=_choices(DISTRIBUTIONS),
                        default=list(DISTRIBUTIONS), help="(a) draft-length distributions: "
                        "uniform (0..K), skewed (0..2 mostly, some K) (default: both)")
    parser.add_argument("--layouts", type=_choices(LAYOUTS), default=list(LAYOUTS),
                        help="(a) verify layouts (default: ragged,padded,eager)")
    parser.add_argument("--verify-k", type=int, default=d.verify_k,
                        help=f"(a) num_speculative_tokens K (default: {d.verify_k})")
    parser.add_argument("--verify-steps", type=int, default=d.verify_steps,
                        help=f"(a) timed verify steps per point (default: {d.verify_steps})")
    parser.add_argument("--verify-warmup", type=int, default=d.verify_warmup,
                        help=f"(a) untimed verify steps first (default: {d.verify_warmup})")
    parser.add_argument("--batch-sizes", type=int_list, default=list(d.e2e_batches),
                        help="(b), (c), (d) batch sizes (default: 1,64)")
    parser.add_argument("--acceptance", type=_float_list, default=list(d.acceptance),
                        help="(b) per-token acceptance rates (default: 0,0.3,0.6,0.8,0.95)")
    parser.add_argument("--ks", type=int_list, default=list(d.ks),
                        help="(b) fixed num_speculative_tokens values; the largest is also "
                        "(b)'s adaptive and (c)'s K (default: 1,2,4,8)")
    parser.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=True,
                        help="(b), (c): also run the adaptive budget (default: on)")
    parser.add_argument("--pipelines", type=_choices(PIPELINE_MODES), default=["auto"],
                        help="(b): run fixed K with each of these speculative_config "
                        "'pipeline' settings (auto, on, off; default: auto)")
    parser.add_argument("--prompt-len", type=int, default=d.prompt_len,
                        help=f"prompt tokens (default: {d.prompt_len})")
    parser.add_argument("--new-tokens", type=int, default=d.new_tokens,
                        help=f"(b)-(d) new tokens per request (default: {d.new_tokens})")
    parser.add_argument("--warmup-tokens", type=int, default=d.warmup_tokens,
                        help="(b)-(d) tokens of the untimed call before each timed one "
                        f"(default: {d.warmup_tokens})")
    parser.add_argument("--draft-model", default=d.draft_model,
                        help=f"(d) the draft model (default: {d.draft_model})")
    parser.add_argument("--draft-k", type=int, default=d.draft_k,
                        help=f"(d) num_speculative_tokens (default: {d.draft_k})")
    parser.add_argument("--bench-seed", type=int, default=0,
                        help="seed of prompts and drafts (default: 0)")
    parser.add_argument("--json", metavar="OUT", default=None,
                        help="write the rows, command line, torch version and device here, "
                        "and PNG plots next to it (OUT stem + _verify, _acceptance, _drafters)")
    EngineArgs.add_cli_args(parser, load_format=None, skip_tokenizer_init=True)
    return parser


def options_from(ns: argparse.Namespace) -> Options:
    return Options(
        parts=tuple(ns.parts), verify_batches=tuple(ns.verify_batch_sizes),
        distributions=tuple(ns.distributions), layouts=tuple(ns.layouts),
        verify_k=ns.verify_k, verify_steps=ns.verify_steps, verify_warmup=ns.verify_warmup,
        e2e_batches=tuple(ns.batch_sizes), acceptance=tuple(ns.acceptance), ks=tuple(ns.ks),
        adaptive=ns.adaptive, pipelines=tuple(ns.pipelines), prompt_len=ns.prompt_len,
        new_tokens=ns.new_tokens, warmup_tokens=ns.warmup_tokens, draft_model=ns.draft_model,
        draft_k=ns.draft_k, seed=ns.bench_seed)


def run_cli(ns: argparse.Namespace, argv: list[str] | None = None) -> int:
    """Entry point of ``replaylm bench spec``."""
    if ns.speculative_config is not None:
        print("error: bench spec sets --speculative-config itself (see --parts, --ks, "
              "--verify-k)", file=sys.stderr)
        return 2
    resolve_model_defaults(ns)
    opts = options_from(ns)
    need = max(opts.verify_batches if "verify" in opts.parts else (1,))
    need = max(need, *opts.e2e_batches)
    ns.max_num_seqs = max(ns.max_num_seqs, need)
    base = EngineArgs.from_cli_args(ns)
    rows, device = run_spec_bench(base, opts)
    print(f"model {ns.model} on {device}, torch {torch.__version__}")
    print(format_table(rows))
    if ns.json:
        write_report(ns.json, rows, {
            "command": command_line(argv), "torch": torch.__version__, "device": device,
            "model": ns.model, "engine_args": dataclasses.asdict(base),
            "options": dataclasses.asdict(opts),
        })
    return 0
