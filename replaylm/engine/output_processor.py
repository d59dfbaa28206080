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
        # No text to make (no tokenizer), no stop strings, no logprobs: a delta is the new
        # tokens alone (``make_delta``'s short path, a per-request, per-step cost).
        self.tokens_only = (tokenizer is None and self.stop.automaton is None
                            and p.logprobs is None and self.sent_prompt_logprobs)

    @property
    def text(self) -> str:
        return self.stop.text


def attach_logprobs(out: SchedulerOutput, pending: PendingStep | None,
                    tokens: list[int]) -> None:
    """Store a step's logprobs on the requests; call before ``Scheduler.update``.

    Only running requests get them: exactly those whose sampled token ``update`` will append.
    ``tokens`` are the step's sampled rows; a verify's rows past its emitted ones hold -1 and
    get no logprobs (``make_delta`` drops those of tokens cut by a stop inside the run).
    """
    if pending is None:
        return
    sampled = pending.sampled_logprobs()
    if sampled is not None:
        row = 0
        for s in out.scheduled:
            if not s.sample:
                continue
            for j in range(row, row + len(s.drafts) + 1):
                lp = sampled[j]
                if lp is not None and tokens[j] >= 0 \
                        and s.request.status is RequestStatus.RUNNING:
                    s.request.output_logprobs.append(lp)
            row += len(s.drafts) + 1
    plan_rows = iter(pending.prompt_logprob_rows())
    for req, count in pending.prompt_spans or []:
        got = [next(plan_rows) for _ in range(count)]
        if req.status is RequestStatus.RUNNING:
            req.prompt_logprobs.extend(got)


def make_delta(req: Request, state: OutputState, scheduler: Scheduler) -> RequestDelta:
    """The delta for ``req`` after a step that gave it a token (or finished it)."""
    sent = state.sent_tokens
    new_ids = req.output_token_ids[sent:]
    if state.tokens_only:
        state.sent_tokens = sent + len(new_ids)
        status = req.status
        return RequestDelta(req.parent_id, new_ids, "", status.finished, status.finish_reason,
                            stop_reason=req.stop_reason if status.finished else None,
                            num_prompt_tokens=req.num_prompt_tokens, index=req.index)
    params = req.sampling_params
    # Several new tokens (a verify's accepted run) go through the stop strings one at a
    # time, so a stop string inside the run ends the output at the token that completes it.
    pieces = [new_ids] if len(new_ids) <= 1 else [[t] for t in new_ids]
    released, count = "", sent
    for j, piece in enumerate(pieces):
        count += len(piece)
        text = state.detok.step(piece)
        if req.is_finished and j == len(pieces) - 1:
            text += state.detok.flush()
        # Stop strings count once more than min_tokens tokens exist (vLLM's rule; EOS and
        # stop ids are masked for the first min_tokens tokens, so the two agree).
        released += state.stop.push(text, check=count > params.min_tokens)
        if state.stop.matched is not None:
            break
    if count < req.num_output_tokens:  # a stop string cut the run: drop what followed it
        del req.output_token_ids[count:]
        new_ids = new_ids[: count - sent]
    if len(req.output_logprobs) > req.num_output_tokens:  # a stop inside a verified run
        del req.output_logprobs[req.num_output_tokens:]
    logprobs = req.output_logprobs[sent:] if params.logprobs is not None else None
    state.sent_tokens = req.num_output_tokens
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
