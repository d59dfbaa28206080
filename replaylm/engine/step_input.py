"""What a tensor-parallel leader sends its group each step (``StepInput``), and how a
verify's acceptance rule crosses the group."""

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
    rows (host tensors, without the requests), and whether the leader's drafter replaces
    verify samples (``accept_from_leader``: the ranks then take the leader's tokens)."""

    host: HostBatch
    admitted: list[SimpleNamespace]
    plan: PromptLogprobPlan | None
    accept_from_leader: bool = False

    @staticmethod
    def of(out: SchedulerOutput, host: HostBatch, accept_from_leader: bool = False
           ) -> StepInput:
        admitted = [SimpleNamespace(slot=r.slot, sampling_params=r.sampling_params, seed=r.seed,
                                    prompt_token_ids=r.prompt_token_ids,
                                    output_token_ids=r.output_token_ids,
                                    eos_token_ids=r.eos_token_ids)
                    for r in out.newly_slotted]
        plan = prompt_plan(out, host, torch.device("cpu"))
        if plan is not None:
            plan = dataclasses.replace(plan, spans=[])
        return StepInput(host, admitted, plan, accept_from_leader)



def sent_to_group(accept: Accept, tp: TensorParallel) -> Accept:
    """The leader's ``accept``, its kept tokens then broadcast to the tensor-parallel group."""
    return lambda logits, tokens: tp.broadcast(accept(logits, tokens).contiguous())


def from_leader(tp: TensorParallel) -> Accept:
    """A follower's acceptance: the tokens the leader's rule kept (``sent_to_group``)."""
    return lambda logits, tokens: tp.broadcast(torch.empty_like(tokens))


def prompt_plan(out: SchedulerOutput, host: HostBatch, device: torch.device
                 ) -> PromptLogprobPlan | None:
    """The step's prompt-logprob rows; the padded verify layout shifts them
    (``host.cu_seqlens_q``)."""
    return plan_prompt_logprobs(out, device,
                                host.cu_seqlens_q if host.layout_pad_tokens else None)
