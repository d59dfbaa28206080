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
  fixed K and the adaptive budget.
- ``ngram`` (c): the n-gram drafter on prompts made of a repeated span, fixed K and
  adaptive against plain (on random weights the output does not repeat the prompt, so
  acceptance is near zero: the point is what the budget does with it).
- ``draft`` (d): ``{"method": "draft_model", "model": M}`` against plain, and the target
  drafting for itself (the upper bound); an engine that refuses the configuration is
  reported with its error.

Every engine is built once (one at a time, the previous one freed) and runs every
measurement that needs it. Prefix caching is off, so repeated prompts (warm-ups) do not
flatter later runs.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from replaylm.bench.common import (
    command_line,
    device_name_of,
    draw,
    int_list,
    png_path,
    random_prompts,
    release_memory,
    resolve_model_defaults,
    write_json,
)
from replaylm.bench.observer import StepObserver, observing
from replaylm.config import EngineArgs
from replaylm.sampling_params import SamplingParams
from replaylm.speculative.protocol import DraftRequest
from replaylm.speculative.stats import SpecStats

PARTS = ("verify", "acceptance", "ngram", "draft")
LAYOUTS = ("ragged", "padded", "eager")
DISTRIBUTIONS = ("uniform", "skewed")
SKEW_SHORT = 0.8  # skewed drafts: this share draws a length in 0..2, the rest K


# Drafters -----------------------------------------------------------------------------------


class NoDrafter:
    """Proposes nothing (requests decode plainly)."""

    def propose(self, requests: Sequence[DraftRequest], max_lens: Sequence[int]
                ) -> list[list[int]]:
        return [[] for _ in requests]


class LengthDrafter:
    """Random draft tokens of lengths drawn from a distribution (``uniform`` over 0..K, or
    ``skewed``: 0..2 with probability ``SKEW_SHORT``, else K)."""

    def __init__(self, distribution: str, k: int, vocab_size: int, seed: int) -> None:
        self.distribution, self.k, self.vocab = distribution, k, vocab_size
        self.rng = np.random.default_rng(seed)

    def length(self) -> int:
        if self.distribution == "uniform":
            return int(self.rng.integers(0, self.k + 1))
        if self.rng.random() < SKEW_SHORT:
            return int(self.rng.integers(0, min(2, self.k) + 1))
        return self.k

    def propose(self, requests: Sequence[DraftRequest], max_lens: Sequence[int]
                ) -> list[list[int]]:
        return [self.rng.integers(0, self.vocab, min(self.length(), m)).tolist()
                for _, m in zip(requests, max_lens)]


class ControlledDrafter:
    """Drafts each request's recorded greedy continuation (``references``: prompt -> output
    of a plain greedy run), every draft token replaced by another token with probability
    ``1 - p``, and decides which drafts the verify accepts (``acceptance``): the drafts it
    left right, up to the first it corrupted.

    Acceptance is imposed rather than left to the target's argmax because bf16 numerics
    differ between batch shapes: a verify row's logits are not bit-equal to the decode
    step's that recorded the reference, and on random weights (near-flat logits) the
    argmax flips within a few tokens, after which the reference says nothing. So the verify
    step, the acceptance kernels, the KV rollback and the host's bookkeeping all run as in
    real speculative decoding, with a known acceptance process: each draft is accepted with
    probability ``p`` given the ones before it were. A request whose output left its
    reference (``diverged``) is drafted random tokens, with the same process.

    ``expected_accepted`` sums, over proposals, the accepted length they imply
    (``p + p² + … + pᵏ``); divided by ``proposals`` it is the mean accepted length to expect
    when no budget trims the drafts.
    """

    def __init__(self, references: dict[tuple[int, ...], list[int]], p: float,
                 vocab_size: int, seed: int) -> None:
        self.refs, self.p, self.vocab = references, p, vocab_size
        self.rng = np.random.default_rng(seed)
        self.diverged: set[tuple[int, ...]] = set()
        self.right: dict[int, list[bool]] = {}  # id(request) -> its latest drafts' marks
        self.proposals = 0
        self.expected_accepted = 0.0

    def propose(self, requests: Sequence[Any], max_lens: Sequence[int]) -> list[list[int]]:
        # One draw of every request's randomness: this runs on the host every step.
        n, k = len(requests), max(max_lens, default=0)
        if not n or k < 1:
            return [[] for _ in requests]
        right = (self.rng.random((n, k)) < self.p).tolist()
        shift = self.rng.integers(1, self.vocab, (n, k)).tolist()
        noise = self.rng.integers(0, self.vocab, (n, k)).tolist()
        return [self._draft(r, m, right[i], shift[i], noise[i])
                for i, (r, m) in enumerate(zip(requests, max_lens))]

    def _draft(self, req: Any, k: int, right: list[bool], shift: list[int],
               noise: list[int]) -> list[int]:
        key = tuple(req.prompt_token_ids)
        ref = self.refs.get(key)
        out = req.output_token_ids
        if ref is None or k < 1:
            return []
        if key not in self.diverged and ref[:len(out)] != out:
            self.diverged.add(key)
        draft = noise[:k] if key in self.diverged else ref[len(out): len(out) + k]
        if not draft:
            return []
        right = right[:len(draft)]
        vocab = self.vocab
        draft = [d if ok else (d + s) % vocab for d, ok, s in zip(draft, right, shift)]
        self.right[id(req)] = right
        self.proposals += 1
        self.expected_accepted += sum(self.p ** j for j in range(1, len(draft) + 1))
        return draft

    @property
    def expected_accepted_length(self) -> float | None:
        return self.expected_accepted / self.proposals if self.proposals else None

    def shadow_accepted(self, req: Any, drafts: list[int], actual: list[int]) -> int:
        """How many of a shadow proposal's drafts the verify would have accepted (the
        adaptive budget's coasting, ``speculative.adaptive``): the leading ones left right."""
        right = self.right[id(req)][:len(drafts)]
        return right.index(False) if False in right else len(right)

    def acceptance(self, out: Any, state: Any) -> Any:
        """``ModelRunner.verify_accept``: each draft row's token becomes its draft when the
        draft was left right, and anything but its draft otherwise (all on the device)."""
        rows: list[int] = []
        drafts: list[int] = []
        right: list[bool] = []
        row = 0
        for s in out.scheduled:
            if not s.sample:
                continue
            k = len(s.drafts)
            if k:
                rows += range(row, row + k)
                drafts += s.drafts
                right += list(self.right[id(s.request)][:k])
            row += k + 1
        if not rows:
            return None
        vocab = self.vocab

        def accept(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
            dev = tokens.device
            rows_t = torch.tensor(rows, dtype=torch.int64).to(dev, non_blocking=True)
            drafts_t = torch.tensor(drafts, dtype=tokens.dtype).to(dev, non_blocking=True)
            right_t = torch.tensor(right).to(dev, non_blocking=True)
            wrong = (drafts_t + 1) % vocab
            sampled = tokens.index_select(0, rows_t)
            new = torch.where(right_t, drafts_t,
                              torch.where(sampled == drafts_t, wrong, sampled))
            return tokens.index_copy(0, rows_t, new)

        return accept


# Measurements -------------------------------------------------------------------------------


class StepTimer(StepObserver):
    """Device time of each step, first operation to last enqueued (CUDA events), or wall
    time of the same span on the CPU; and the dispatch of each step."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.ms: list[float] = []
        self.dispatch: dict[str, int] = {}
        self._start: Any = None
        self._stop: Any = None

    def launching(self) -> None:
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()

    def launched(self, mode: str, tier: int | None, tokens: int) -> None:
        if self.cuda:
            self._stop = torch.cuda.Event(enable_timing=True)
            self._stop.record()
        else:
            self._stop = time.perf_counter()
        key = f"{mode}:{tier}" if tier is not None else mode
        self.dispatch[key] = self.dispatch.get(key, 0) + 1

    def end(self, launched: bool) -> None:
        if not launched:
            return
        if self.cuda:
            self._stop.synchronize()
            self.ms.append(self._start.elapsed_time(self._stop))
        else:
            self.ms.append((self._stop - self._start) * 1e3)


def stats_between(before: SpecStats, after: SpecStats) -> dict[str, Any]:
    """``SpecStats.as_dict`` of the counts added between two snapshots."""
    diff = copy.copy(after)
    for f in dataclasses.fields(SpecStats):
        v = getattr(after, f.name)
        if isinstance(v, int) and not isinstance(v, bool) and f.name != "num_speculative_tokens":
            setattr(diff, f.name, v - getattr(before, f.name))
    return diff.as_dict()


def verify_point(llm: Any, batch: int, distribution: str, k: int, steps: int, warmup: int,
                 prompt_len: int, seed: int) -> dict[str, Any]:
    """Part (a): ``steps`` timed verify steps of ``batch`` decoding requests."""
    core = llm.engine
    vocab = int(llm.model_config.vocab_size)
    layout = core.runner.spec.verify
    prompts = random_prompts(batch, prompt_len, vocab, seed + batch)
    # Each step emits at least one token per request; leave room for every step's drafts.
    sp = SamplingParams(temperature=0.0, max_tokens=(warmup + steps + 4) * (k + 1),
                        ignore_eos=True)
    core.use_drafter(NoDrafter())
    ids = [f"verify-{distribution}-{batch}-{i}" for i in range(batch)]
    for rid, p in zip(ids, prompts):
        core.add_request(rid, p, sp)
    for _ in range(10_000):  # prefill (chunked as the engine chunks it)
        running = core.scheduler.running
        if len(running) == batch and all(r.num_output_tokens >= 1 and
                                         r.num_computed_tokens == r.num_tokens - 1
                                         for r in running):
            break
        core.step()
    core.use_drafter(LengthDrafter(distribution, k, vocab, seed))
    for _ in range(warmup):
        core.step()
    timer = StepTimer(llm.device)
    before = copy.copy(core.spec_stats)
    with observing(core, timer):
        for _ in range(steps):
            core.step()
    st = stats_between(before, core.spec_stats)
    for rid in ids:
        core.abort(rid)
    ms = np.asarray(timer.ms)
    return {
        "part": "verify", "layout": layout, "batch": batch, "distribution": distribution,
        "k": k, "steps": len(ms), "step_ms_median": float(np.median(ms)),
        "step_ms_mean": float(ms.mean()), "step_ms_min": float(ms.min()),
        "verify_steps": st["verify_steps"],
        "draft_tokens_per_step": st["draft_tokens_per_step"],
        "real_tokens_per_step": st["verify_step_tokens"] / max(1, st["verify_steps"]),
        "run_tokens_per_step": st["verify_step_padded_tokens"] / max(1, st["verify_steps"]),
        "padded_waste": st["padded_waste"], "layout_pad_tokens": st["layout_pad_tokens"],
        "dispatch": timer.dispatch,
    }


def _sync(llm: Any) -> None:
    if llm.device.type == "cuda":
        torch.cuda.synchronize(llm.device)


def generate_timed(llm: Any, prompts: list[list[int]], new_tokens: int
                   ) -> tuple[float, list[list[int]]]:
    """Wall seconds of one greedy ``generate`` call and each prompt's output tokens."""
    sp = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    _sync(llm)
    start = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    _sync(llm)
    return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outs]


def e2e_run(llm: Any, prompts: list[list[int]], new_tokens: int, warmup_tokens: int
            ) -> tuple[dict[str, Any], list[list[int]]]:
    """One warm-up call (the same prompts, ``warmup_tokens`` each), then one timed call;
    the row's timing and spec figures, and the outputs."""
    if warmup_tokens:
        generate_timed(llm, prompts, warmup_tokens)
    core = llm.engine
    before = copy.copy(core.spec_stats) if core.spec_stats is not None else None
    wall, outs = generate_timed(llm, prompts, new_tokens)
    generated = sum(map(len, outs))
    row: dict[str, Any] = {"batch": len(prompts), "new_tokens": new_tokens,
                           "generated_tokens": generated, "wall_s": wall,
                           "tok_s": generated / wall}
    if before is not None:
        st = stats_between(before, core.spec_stats)
        row.update({name: st[name] for name in (
            "mean_accepted_length", "per_token_acceptance", "acceptance_rate",
            "budget_tokens_per_step", "draft_tokens_per_step", "verify_steps", "steps",
            "draft_tokens", "accepted_tokens", "padded_waste")})
    return row, outs


def repeated_span_prompts(n: int, length: int, vocab_size: int, seed: int,
                          span: int = 8) -> list[list[int]]:
    """``n`` prompts of ``length`` tokens, each a random ``span``-token run repeated (so the
    n-gram drafter finds matches in the prompt)."""
    return [(head * (length // span + 1))[:length]
            for head in random_prompts(n, span, vocab_size, seed)]


# The plan: which engines, which measurements on each ----------------------------------------


@dataclasses.dataclass
class Options:
    parts: tuple[str, ...] = PARTS
    verify_batches: tuple[int, ...] = (1, 4, 16, 64)
    distributions: tuple[str, ...] = DISTRIBUTIONS
    layouts: tuple[str, ...] = LAYOUTS
    verify_k: int = 8
    verify_steps: int = 20
    verify_warmup: int = 3
    e2e_batches: tuple[int, ...] = (1, 64)
    acceptance: tuple[float, ...] = (0.0, 0.3, 0.6, 0.8, 0.95)
    ks: tuple[int, ...] = (1, 2, 4, 8)
    adaptive: bool = True
    prompt_len: int = 32
    new_tokens: int = 128
    warmup_tokens: int = 64
    draft_model: str = "llama3.2-1b"
    draft_k: int = 4
    seed: int = 0


def _ngram(k: int, budget: str = "fixed", verify: str = "ragged") -> dict[str, Any]:
    return {"method": "ngram", "num_speculative_tokens": k, "budget": budget, "verify": verify}


def engine_plan(opts: Options, target_model: str
                ) -> list[tuple[str, dict[str, Any] | None, set[str]]]:
    """``(label, speculative_config, roles)`` per engine, plain first (its outputs are the
    controlled drafter's references). Roles: ``plain``, ``layout``, ``controlled``,
    ``ngram``, ``draft``."""
    plan: dict[str, tuple[dict[str, Any] | None, set[str]]] = {}

    def add(label: str, spec: dict[str, Any] | None, role: str) -> None:
        plan.setdefault(label, (spec, set()))[1].add(role)

    parts, kmax = set(opts.parts), max(opts.ks)
    if parts & {"acceptance", "ngram", "draft"}:
        add("plain", None, "plain")
    if "verify" in parts:
        for layout in opts.layouts:
            label = (f"fixed-k{opts.verify_k}" if layout == "ragged"
                     else f"verify-{layout}-k{opts.verify_k}")
            add(label, _ngram(opts.verify_k, verify=layout), "layout")
    for role in ("acceptance", "ngram"):
        if role not in parts:
            continue
        for k in opts.ks if role == "acceptance" else (kmax,):
            add(f"fixed-k{k}", _ngram(k), "controlled" if role == "acceptance" else role)
        if opts.adaptive:
            add(f"adaptive-k{kmax}", _ngram(kmax, "adaptive"),
                "controlled" if role == "acceptance" else role)
    if "draft" in parts:
        for label, model in (("draft-model", opts.draft_model), ("self-draft", target_model)):
            add(label, {"method": "draft_model", "model": model,
                        "num_speculative_tokens": opts.draft_k}, "draft")
    return [(label, spec, roles) for label, (spec, roles) in plan.items()]


def _config_of(label: str, spec: dict[str, Any] | None) -> dict[str, Any]:
    if spec is None:
        return {"config": "plain", "k": 0, "budget": None}
    return {"config": label, "k": spec["num_speculative_tokens"],
            "budget": spec.get("budget", "fixed")}


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
                rows.append({"part": "draft", "batch": bs, **_config_of(label, spec),
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
        cfg = _config_of(label, spec)
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
                lines.append(f"  {r['config']:<14} batch {r['batch']:>3}: {r['error']}")
                continue
            p = f" p={r['p']}" if r.get("p") is not None else ""
            extra = ""
            if r.get("mean_accepted_length") is not None:
                extra = (f"  accepted {r['mean_accepted_length']:.2f}/verify "
                         f"(per token {r['per_token_acceptance']:.3f})  budget "
                         f"{r['budget_tokens_per_step']:.2f}")
            lines.append(f"  {r['config']:<14}{p:<7} batch {r['batch']:>3}: "
                         f"{r['tok_s']:>10,.1f} tok/s  x{r.get('speedup', 0):.2f}{extra}")
    return "\n".join(lines)


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
        adaptive=ns.adaptive, prompt_len=ns.prompt_len, new_tokens=ns.new_tokens,
        warmup_tokens=ns.warmup_tokens, draft_model=ns.draft_model, draft_k=ns.draft_k,
        seed=ns.bench_seed)


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
        write_json(ns.json, {
            "command": command_line(argv), "torch": torch.__version__, "device": device,
            "model": ns.model, "engine_args": dataclasses.asdict(base),
            "options": dataclasses.asdict(opts), "rows": rows,
        })
        title = f"{ns.model} on {device}"
        figures = []
        if any(r["part"] == "verify" for r in rows):
            figures.append(("spec_verify", (rows, png_path(ns.json, "verify"), title)))
        if any(r["part"] == "acceptance" and r.get("p") is not None for r in rows):
            figures.append(("spec_acceptance", (rows, png_path(ns.json, "acceptance"), title)))
        if any(r["part"] in ("ngram", "draft") and r.get("tok_s") for r in rows):
            figures.append(("spec_drafters", (rows, png_path(ns.json, "drafters"), title)))
        draw(figures)
    return 0
