"""The measurements of ``bench spec``: the time of verify steps (part (a),
:func:`verify_point`) and end-to-end greedy runs with their speculative figures
(:func:`e2e_run`, parts (b)-(d)), on an engine already built."""

from __future__ import annotations

import copy
import dataclasses
import time
from typing import Any

import numpy as np
import torch

from replaylm.bench.common import random_prompts
from replaylm.bench.observer import StepObserver, observing
from replaylm.bench.spec_drafters import LengthDrafter, NoDrafter
from replaylm.sampling_params import SamplingParams
from replaylm.speculative.stats import SpecStats


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
        if isinstance(v, (int, float)) and f.name not in SpecStats.SETTINGS:
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
            "draft_tokens", "accepted_tokens", "padded_waste", "pipelined_steps",
            "expected_tokens_per_verify", "priced_ms_per_verify", "measured_tokens_per_verify",
            "measured_ms_per_verify")})
    return row, outs


def repeated_span_prompts(n: int, length: int, vocab_size: int, seed: int,
                          span: int = 8) -> list[list[int]]:
    """``n`` prompts of ``length`` tokens, each a random ``span``-token run repeated (so the
    n-gram drafter finds matches in the prompt)."""
    return [(head * (length // span + 1))[:length]
            for head in random_prompts(n, span, vocab_size, seed)]
