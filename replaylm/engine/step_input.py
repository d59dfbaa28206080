"""What a tensor-parallel leader sends its group each step (``StepInput``), and how the
leader's tokens reach the group when only the leader can sample them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from replaylm.batch import HostBatch
from replaylm.engine.prompt_logprobs import plan_prompt_logprobs
from replaylm.engine.scheduler import SchedulerOutput
from replaylm.model.parallel import (
    TensorParallel,
)
from replaylm.sampling.step import Accept, PromptLogprobPlan


@dataclass
class StepInput:
    """One step as a tensor-parallel leader sends it to the other ranks of its group: the
    host batch (a verify's layout included: drafts, ``draft_next`` / ``seg_start``, padding
    rows, penalty rows), the sampling settings of newly slotted requests, the prompt-logprob
    rows (host tensors, without the requests), and whether the ranks take the leader's sampled
    tokens in place of their own (``tokens_from_leader``): when the leader's drafter replaces
    verify samples (its proposals' distributions live on the leader alone) or when a
    structured-output mask applies to the step (the grammars and their masks live on the
    leader alone, ``structured.masks``)."""

    host: HostBatch
    admitted: list[SimpleNamespace]
    plan: PromptLogprobPlan | None
    tokens_from_leader: bool = False

    @staticmethod
    def of(out: SchedulerOutput, host: HostBatch, tokens_from_leader: bool = False
           ) -> StepInput:
        admitted = [SimpleNamespace(slot=r.slot, sampling_params=r.sampling_params, seed=r.seed,
                                    prompt_token_ids=r.prompt_token_ids,
                                    output_token_ids=r.output_token_ids,
                                    eos_token_ids=r.eos_token_ids)
                    for r in out.newly_slotted]
        plan = prompt_plan(out, host, torch.device("cpu"))
        if plan is not None:
            plan = dataclasses.replace(plan, spans=[])
        return StepInput(host, admitted, plan, tokens_from_leader)



def sent_to_group(accept: Accept | None, tp: TensorParallel) -> Accept:
    """The leader's tokens, broadcast to the tensor-parallel group: those its ``accept`` kept,
    or (None) those it sampled. One ``[L]`` int64 broadcast, outside the graphs."""
    keep = accept if accept is not None else (lambda logits, tokens: tokens)
    return lambda logits, tokens: tp.broadcast(keep(logits, tokens).contiguous())


def from_leader(tp: TensorParallel) -> Accept:
    """A follower's tokens: the leader's (``sent_to_group``), in place of its own samples."""
    return lambda logits, tokens: tp.broadcast(torch.empty_like(tokens))


def prompt_plan(out: SchedulerOutput, host: HostBatch, device: torch.device
                 ) -> PromptLogprobPlan | None:
    """The step's prompt-logprob rows; the padded verify layout shifts them
    (``host.cu_seqlens_q``)."""
    return plan_prompt_logprobs(out, device,
                                host.cu_seqlens_q if host.layout_pad_tokens else None)
