"""One step's sampling tail: logit processing, sampling, logprobs, and the copy to the host.

The runner calls ``StepSampler.run`` once, right after ``compute_logits``. Rows ``[0, L)`` of
the logits are the sampled rows (``batch.sample_slots``); rows after them, if any, are the
prompt-logprob rows of ``batch.prompt_logprobs``. Which optional parts run is decided from
host-side per-slot mirrors, so a batch that uses none of them runs the plain ``sample`` path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from replaylm.sampling.logprobs import DeviceLogprobs, TokenLogprobs, device_logprobs
from replaylm.sampling.penalties import LogitsProcessorState
from replaylm.sampling.sampler import SamplingState, sample
from replaylm.sampling_params import SamplingParams

#: What a slot holds when its request's settings could not be written: greedy, no
#: processing. The step runs the row harmlessly; its sample is dropped.
_NEUTRAL = SamplingParams(temperature=0.0, max_tokens=1)


@dataclass
class PromptLogprobPlan:
    """Prompt-logprob rows of one step: packed rows, the prompt token each row scores, top-k.

    ``spans`` lists ``(request, count)`` in row order: the request's next ``count`` prompt
    logprobs come from these rows.
    """

    rows: torch.Tensor  # [P] int64, packed row indices (device)
    targets: torch.Tensor  # [P] int64, prompt token at position row + 1 (device)
    ks: list[int]  # [P] top-k per row (host)
    spans: list[tuple[Any, int]]


#: Maps a step's sampled tokens to other tokens of the same shape.
TokenMap = Callable[[torch.Tensor], torch.Tensor]
#: A verify's acceptance rule: (processed logits, sampled tokens) -> the tokens kept.
Accept = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class SampleRows:
    """One step's sampled rows, as ``StepSampler.run`` takes them.

    ``logits``: the sampled rows first, then the prompt-logprob rows of ``plan``, if any;
    ``slots`` / ``out_pos``: each sampled row's request slot and output position (device),
    ``slots_cpu`` the slots on the host. ``samples``, when given, holds the rows' samples
    drawn in the step's tail (``graphs.whole``; the argmax of every row unless
    ``StepSampler.tail_draws``): a batch whose rows need nothing more (no logit processing;
    greedy, or drawn in the tail without top-k or top-p) takes them as they are, with no
    kernel here. ``host_view``, when given, maps the sampled tokens
    to what the host receives (a verify step's acceptance): only those rows count as outputs
    for the penalties. ``draft_counts``: ``(rows, tokens)``, draft tokens each verify row's
    penalties count as earlier outputs. ``accept``, when given, maps (processed logits,
    sampled tokens) to the tokens the step keeps: a drafter whose proposals carry a
    distribution replaces its draft rows' samples by its rejection sampling
    (``engine.draft_model``), a benchmark drafter imposes which drafts are accepted
    (``bench.spec_drafters.ControlledDrafter``), and a tensor-parallel follower takes its
    leader's tokens (``engine.step_input``: a draft model's, or a structured-output step's).
    """

    logits: torch.Tensor
    slots: torch.Tensor
    out_pos: torch.Tensor
    slots_cpu: list[int]
    plan: PromptLogprobPlan | None = None
    samples: torch.Tensor | None = None
    host_view: TokenMap | None = None
    draft_counts: tuple[torch.Tensor, torch.Tensor] | None = None
    accept: Accept | None = None


@dataclass
class PendingStep:
    """Results of a launched step; the accessors wait for the copies to the host first."""

    device_tokens: torch.Tensor
    host_tokens: torch.Tensor
    event: torch.cuda.Event | None
    sample_logprobs: DeviceLogprobs | None = None
    sample_ks: list[int | None] | None = None
    prompt_logprobs: DeviceLogprobs | None = None
    prompt_ks: list[int] | None = None
    prompt_spans: list[tuple[Any, int]] | None = None  # the plan's (request, count) pairs

    def _wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()
            self.event = None

    def tokens(self) -> list[int]:
        self._wait()
        return self.host_tokens.tolist()

    def sampled_logprobs(self) -> list[TokenLogprobs | None] | None:
        """Per sampled row: its logprobs, or ``None`` where that request did not ask."""
        if self.sample_logprobs is None:
            return None
        self._wait()
        return self.sample_logprobs.rows(self.sample_ks or [])

    def prompt_logprob_rows(self) -> list[TokenLogprobs]:
        if self.prompt_logprobs is None:
            return []
        self._wait()
        ks: list[int | None] = list(self.prompt_ks or [])
        return [row for row in self.prompt_logprobs.rows(ks) if row is not None]


class StepSampler:
    """Per-slot device state for sampling (``SamplingState``, ``LogitsProcessorState``) and the
    host-side logprob settings, plus the per-step sampling tail."""

    def __init__(self, max_num_seqs: int, vocab_size: int, device: torch.device,
                 max_rows: int | None = None) -> None:
        self.device = device
        self.state = SamplingState(max_num_seqs, device, vocab_size)
        self.procs = LogitsProcessorState(max_num_seqs, vocab_size, device)
        self._logprobs_k: list[int | None] = [None] * max_num_seqs
        # Whether a step's tail draws temperature rows by the slots' settings (the runner
        # hands ``state`` to its graphs), so ``SampleRows.samples`` hold them; else only the
        # greedy rows' samples are final there.
        self.tail_draws = False
        # Two pinned buffers and events, alternating: allocating pinned memory every step costs
        # about as much as a small model's whole step. With overlap scheduling step N+1 is
        # launched before step N's tokens are read on the host, so N+1 must copy elsewhere.
        cuda = device.type == "cuda"
        rows = max_num_seqs if max_rows is None else max_rows  # sampled rows per step
        self._pinned = [torch.empty(rows, dtype=torch.int64, pin_memory=True)
                        for _ in range(2)] if cuda else []
        self._ready = [torch.cuda.Event() for _ in range(2)] if cuda else []
        self._flip = 0
        # Requests whose settings could not be written: (request, error), taken by the engine.
        self.failed: list[tuple[Any, Exception]] = []

    def admit(self, req: Any) -> None:
        """Write a newly slotted request's settings into its slot (outside any graph); the
        per-slot scalars reach the device at ``flush``.

        A failure belongs to this request alone: its slot gets neutral settings, so the step
        runs on for everyone, and the request is listed in ``failed`` for the engine to finish
        with an error. Only a failure to write the neutral settings propagates.
        """
        p = req.sampling_params
        try:
            self.state.set(req.slot, p, req.seed)
            self.procs.set(req.slot, p, req.prompt_token_ids, req.output_token_ids,
                           () if p.ignore_eos else req.eos_token_ids)
            self._logprobs_k[req.slot] = p.logprobs
        except Exception as e:  # any failure here is this request's
            self.state.set(req.slot, _NEUTRAL, 0)
            self.procs.set(req.slot, _NEUTRAL, [], [], ())
            self._logprobs_k[req.slot] = None
            self.failed.append((req, e))

    def take_failed(self) -> list[tuple[Any, Exception]]:
        """The requests whose admission failed since the last call."""
        failed, self.failed = self.failed, []
        return failed

    def flush(self) -> None:
        """Send the settings of the requests admitted since the last flush to the device, one
        copy per settings matrix (before the step that first samples them)."""
        self.state.flush()
        self.procs.flush()

    def run(self, rows: SampleRows) -> PendingStep:
        """Sample ``rows`` (rows ``[0, len(rows.slots_cpu))`` of its logits); score the
        prompt-logprob plan's rows after them.

        Returns the step's results with their host copies started (CUDA: pinned memory,
        non-blocking, one event recorded after all of them).
        """
        logits, sample_slots, sample_out_pos = rows.logits, rows.slots, rows.out_pos
        slots_cpu, plan, samples = rows.slots_cpu, rows.plan, rows.samples
        host_view, draft_counts, accept = rows.host_view, rows.draft_counts, rows.accept
        num_sampled = len(slots_cpu)
        raw = logits[:num_sampled]
        all_greedy = self.state.all_greedy(slots_cpu)
        procs_active = self.procs.active(slots_cpu)
        need_filter = not all_greedy and self.state.needs_filter(slots_cpu)
        if samples is not None and not procs_active and (
                all_greedy or (self.tail_draws and not need_filter)):
            tokens = samples if accept is None else accept(raw, samples)
        elif num_sampled:
            x = raw
            if procs_active:
                x = self.procs.apply(raw, sample_slots, sample_out_pos, self.state.temperature,
                                     slots_cpu, draft_counts)
            tokens = sample(x, sample_slots, sample_out_pos, self.state, all_greedy=all_greedy,
                            need_filter=need_filter)
            if accept is not None:
                tokens = accept(x, tokens)
        else:
            tokens = torch.empty(0, dtype=torch.int64, device=self.device)
        shown = tokens if host_view is None else host_view(tokens)
        if num_sampled and tokens is not samples:
            self.procs.record(sample_slots, tokens, slots_cpu,
                              None if host_view is None else shown >= 0)
        ks = [self._logprobs_k[s] for s in slots_cpu]
        sample_lp = None
        if any(k is not None for k in ks):
            sample_lp = device_logprobs(raw, tokens, max(k for k in ks if k is not None))
        prompt_lp = None
        if plan is not None:
            prompt_lp = device_logprobs(logits[num_sampled:], plan.targets, max(plan.ks))
        pin = self.device.type == "cuda"
        # Off CUDA there is no copy to the host: keep a snapshot, since ``tokens`` may be a
        # graph's output that the next step (launched before this one is read) overwrites.
        host_tokens = shown if pin else shown.clone()
        event = None
        if pin:
            host_tokens = self._pinned[self._flip][: tokens.shape[0]]
            host_tokens.copy_(shown, non_blocking=True)
        if sample_lp is not None:
            sample_lp = sample_lp.to_host(pin)
        if prompt_lp is not None:
            prompt_lp = prompt_lp.to_host(pin)
        if pin:
            event = self._ready[self._flip]
            event.record()
            self._flip ^= 1
        return PendingStep(tokens, host_tokens, event, sample_lp, ks if sample_lp is not None else None,
                           prompt_lp, plan.ks if plan is not None else None,
                           plan.spans if plan is not None else None)
