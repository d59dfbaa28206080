"""Turns a step's changed requests into ``RequestDelta``s: detokenization, stop strings,
logprobs. A stop string found here finishes the request (blocks freed) in the same step."""

from __future__ import annotations

from typing import Any

from replaylm.engine.detokenizer import IncrementalDetokenizer
from replaylm.engine.outputs import RequestDelta
from replaylm.engine.request import Request, RequestStatus
from replaylm.engine.scheduler import Scheduler, SchedulerOutput
from replaylm.engine.stop_strings import StopStringBuffer
from replaylm.sampling.step import PendingStep


class OutputState:
    """Per-request streaming state: the detokenizer, the stop-string buffer, what was sent."""

    def __init__(self, req: Request, tokenizer: Any) -> None:
        p = req.sampling_params
        self.detok = IncrementalDetokenizer(tokenizer, p.skip_special_tokens, req.prompt_token_ids)
        self.stop = StopStringBuffer(p.stop or [], p.include_stop_str_in_output)
        self.sent_tokens = 0
        self.sent_prompt_logprobs = req.prompt_logprobs_k is None

    @property
    def text(self) -> str:
        return self.stop.text


def attach_logprobs(out: SchedulerOutput, pending: PendingStep | None) -> None:
    """Store a step's logprobs on the requests; call before ``Scheduler.update``.

    Only running requests get them: exactly those whose sampled token ``update`` will append.
    """
    if pending is None:
        return
    sampled = pending.sampled_logprobs()
    if sampled is not None:
        rows = iter(sampled)
        for s in out.scheduled:
            if not s.sample:
                continue
            lp = next(rows)
            if lp is not None and s.request.status is RequestStatus.RUNNING:
                s.request.output_logprobs.append(lp)
    plan_rows = iter(pending.prompt_logprob_rows())
    for req, count in pending.prompt_spans or []:
        got = [next(plan_rows) for _ in range(count)]
        if req.status is RequestStatus.RUNNING:
            req.prompt_logprobs.extend(got)


def make_delta(req: Request, state: OutputState, scheduler: Scheduler) -> RequestDelta:
    """The delta for ``req`` after a step that gave it a token (or finished it)."""
    params = req.sampling_params
    new_ids = req.output_token_ids[state.sent_tokens:]
    logprobs = req.output_logprobs[state.sent_tokens:] if params.logprobs is not None else None
    state.sent_tokens = req.num_output_tokens
    text = state.detok.step(new_ids)
    if req.is_finished:
        text += state.detok.flush()
    # Stop strings count once more than min_tokens tokens exist (vLLM's rule; EOS and stop ids
    # are masked for the first min_tokens tokens, so the two agree).
    released = state.stop.push(text, check=req.num_output_tokens > params.min_tokens)
    if state.stop.matched is not None:
        if not req.is_finished:
            scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
        else:
            req.status = RequestStatus.FINISHED_STOPPED  # e.g. the last token before "length"
        req.stop_reason = state.stop.matched
    elif req.is_finished:
        released += state.stop.flush()
    prompt_lps = None
    if not state.sent_prompt_logprobs and new_ids:
        prompt_lps = [None, *req.prompt_logprobs]
        state.sent_prompt_logprobs = True
    return RequestDelta(
        req.parent_id, new_ids, released, req.is_finished, req.status.finish_reason,
        stop_reason=req.stop_reason if req.is_finished else None, logprobs=logprobs,
        prompt_logprobs=prompt_lps, num_prompt_tokens=req.num_prompt_tokens, index=req.index,
    )
