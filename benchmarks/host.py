"""Host-path benchmark: the engine's own per-step work at N decoding requests, model stubbed.

The model's forward and LM head return zeros, so a step costs scheduling, batch building, the
input copy, an argmax over N rows, and turning samples into outputs. That is the work overlap
scheduling has to hide behind the GPU's step; run it on the serving host to see the margin.

    PYTHONPATH=. python benchmarks/host.py --requests 256 --steps 64 [--profile]

``--model NAME --device cuda`` runs that model for real instead (random weights for a named
shape), graphs and all: with ``--profile`` the top functions then show where the host's
time goes beside a real step, the device path's own calls included.

It prints the median and mean step and the time Python's garbage collector took during the
decode phase.

``--spec-k K --acceptance P`` runs verify steps instead: n-gram speculation with K drafts
per request, proposed by ``bench.spec_drafters.ControlledDrafter`` (the stub emits token 0,
so the drafts are zeros, each corrupted with probability ``1 - P``, and the verify accepts
the ones left right up to the first corrupted one). ``--pipeline`` is
``speculative_config['pipeline']`` (``on``: two cohorts take turns, each step half the
requests).

    PYTHONPATH=. python benchmarks/host.py --requests 64 --steps 128 --spec-k 4 --acceptance 0.8
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import statistics
import time
from unittest import mock

import torch

from replaylm import LLM, SamplingParams
from replaylm.sampling import sampler as sampler_mod


def host_step_ms(requests: int, steps: int, prompt_len: int = 128,
                 profile: cProfile.Profile | None = None, waves: int = 1,
                 model: str | None = None, device: str = "cpu", spec_k: int = 0,
                 acceptance: float = 0.8, pipeline: str = "off",
                 **engine_args: object) -> tuple[list[float], float]:
    """Wall ms of each step after the first wave's prefill, and the ms the garbage collector
    took in them. ``waves`` > 1: a closed loop, as ``bench decode`` runs it: each finished
    request is replaced by a new one until ``waves * requests`` have been added (their
    prefills then run beside the decodes). ``model``: run it for real on ``device`` (random
    weights), not the stubbed built-in model on the CPU. ``spec_k`` > 0 (stub only): verify
    steps of up to ``spec_k`` drafts accepted at rate ``acceptance`` (``pipeline``: the
    ``speculative_config`` key)."""
    max_len = prompt_len + steps + 8
    if spec_k:
        if model is not None:
            raise ValueError("spec_k needs the stubbed model (its drafts are its zeros)")
        spec = {"method": "ngram", "num_speculative_tokens": spec_k}
        if pipeline != "off":  # the default (auto) never pipelines on the CPU
            spec["pipeline"] = pipeline
        engine_args["speculative_config"] = spec
    if model is not None:
        llm = LLM(model, device=device, max_num_seqs=requests, max_model_len=max_len,
                  load_format="dummy", skip_tokenizer_init=True, **engine_args)
        return _decode(llm, requests, steps, prompt_len, waves, profile, spec_k, acceptance)
    llm = LLM("default", device="cpu", max_num_seqs=requests, max_model_len=max_len,
              num_kv_blocks=requests * (max_len // 16 + 2) + 1, skip_tokenizer_init=True,
              **engine_args)
    net = llm.engine.runner.model
    hidden = net.cfg.hidden_size
    # Stubs: no layers and no LM head, so what is left is the engine's own host work.
    net.forward = lambda ids, pos, meta, embedded=None, rows=None: torch.zeros(
        ids.shape[0] if rows is None else rows.shape[0], hidden)
    logits = torch.zeros(max(requests, 8192), net.cfg.vocab_size)
    net.compute_logits = lambda h, out=None: logits[: h.shape[0]]
    # Every request is greedy: the sampler's exponential race (one kernel on a GPU, the
    # torch reference here) would only add the CPU's arithmetic over the vocabulary.
    with mock.patch.object(sampler_mod, "race", _argmax_race):
        return _decode(llm, requests, steps, prompt_len, waves, profile, spec_k, acceptance)


def _argmax_race(logits: torch.Tensor, temperature: torch.Tensor, *args: object,
                 **kwargs: object) -> torch.Tensor:
    assert not bool((temperature != 0).any()), "the host benchmark samples greedily"
    return logits.argmax(dim=-1)


def _decode(llm: LLM, requests: int, steps: int, prompt_len: int, waves: int,
            profile: cProfile.Profile | None, spec_k: int, acceptance: float
            ) -> tuple[list[float], float]:
    vocab = llm.engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, vocab, (requests * waves, prompt_len),
                            generator=g).tolist()
    sp = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    core = llm.engine
    if spec_k:  # the stub's greedy output is all zeros: the references the drafts corrupt
        from replaylm.bench.spec_drafters import ControlledDrafter

        refs = {tuple(p): [0] * steps for p in prompts}
        core.use_drafter(ControlledDrafter(refs, acceptance, vocab, seed=0))
    for i in range(requests):
        core.add_request(str(i), prompts[i], sp)
    added = requests
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running) \
            or core.scheduler.num_waiting:
        core.step()  # prefill
    times: list[float] = []
    gc_s, gc_start = [0.0], [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_start[0] = time.perf_counter()
        else:
            gc_s[0] += time.perf_counter() - gc_start[0]

    gc.callbacks.append(on_gc)
    if profile is not None:
        profile.enable()
    while core.has_unfinished():
        start = time.perf_counter()
        for delta in core.step():
            if delta.finished and added < len(prompts):
                core.add_request(str(added), prompts[added], sp)
                added += 1
        times.append((time.perf_counter() - start) * 1e3)
    if profile is not None:
        profile.disable()
    gc.callbacks.remove(on_gc)
    return times, gc_s[0] * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--profile", action="store_true", help="print the top functions (cProfile)")
    ap.add_argument("--waves", type=int, default=1,
                    help="requests added in all, in multiples of --requests: above 1, a closed "
                         "loop (a finished request replaced at once)")
    ap.add_argument("--model", default=None,
                    help="run this model for real (random weights) instead of the stub")
    ap.add_argument("--device", default="cpu", help="with --model: where it runs")
    ap.add_argument("--spec-k", type=int, default=0,
                    help="verify steps with up to this many drafts per request (stub only)")
    ap.add_argument("--acceptance", type=float, default=0.8,
                    help="with --spec-k: each draft's chance to be accepted")
    ap.add_argument("--pipeline", choices=("off", "on"), default="off",
                    help="with --spec-k: speculative_config['pipeline']")
    ns = ap.parse_args(argv)
    prof = cProfile.Profile() if ns.profile else None
    times, gc_ms = host_step_ms(ns.requests, ns.steps, profile=prof, waves=ns.waves,
                                model=ns.model, device=ns.device, spec_k=ns.spec_k,
                                acceptance=ns.acceptance, pipeline=ns.pipeline)
    what = "model stubbed, CPU" if ns.model is None else f"{ns.model} on {ns.device}"
    if ns.spec_k:
        what += f", verify steps of up to {ns.spec_k} drafts at acceptance {ns.acceptance}"
        what += ", pipelined" if ns.pipeline == "on" else ""
    print(f"{ns.requests} requests: {statistics.median(times):.2f} ms per decode step, median "
          f"of {len(times)} (mean {statistics.fmean(times):.2f}; garbage collection "
          f"{gc_ms:.0f} ms in all; {what})")
    if prof is not None:
        pstats.Stats(prof).sort_stats("tottime").print_stats(20)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
