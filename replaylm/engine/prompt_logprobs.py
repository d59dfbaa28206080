"""Which packed rows of a step score prompt tokens, for requests that asked for prompt logprobs.

The logits of packed row for position ``p`` predict the token at ``p + 1``, so a prefill chunk
``[start, start + n)`` scores prompt tokens ``start + 1 .. start + n`` (the last prompt
position predicts the first output token and is the sampled row, not a prompt logprob).
Positions already scored (``len(req.prompt_logprobs)``) are skipped, so a recompute after a
preemption never scores a token twice; chunked prefill scores each chunk as it runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from replaylm.engine.scheduler import SchedulerOutput
from replaylm.sampling.step import PromptLogprobPlan


def plan_prompt_logprobs(out: SchedulerOutput, device: torch.device,
                         cu_seqlens_q: Sequence[int] | None = None) -> PromptLogprobPlan | None:
    """The step's prompt-logprob rows, or ``None`` when no scheduled request needs any.
    ``cu_seqlens_q``: where each request's rows start in the packed batch (default: the
    requests' tokens end to end; given when the layout pads requests)."""
    rows: list[int] = []
    targets: list[int] = []
    ks: list[int] = []
    spans = []
    base = 0
    for i, sr in enumerate(out.scheduled):
        req, start, n = sr.request, sr.start, sr.num_new_tokens
        if cu_seqlens_q is not None:
            base = int(cu_seqlens_q[i])
        k = req.prompt_logprobs_k
        if k is not None:
            first = max(start, len(req.prompt_logprobs))
            stop = min(start + n, req.num_prompt_tokens - 1)
            if first < stop:
                rows.extend(range(base + first - start, base + stop - start))
                targets.extend(req.prompt_token_ids[first + 1 : stop + 1])
                ks.extend([k] * (stop - first))
                spans.append((req, stop - first))
        base += n
    if not rows:
        return None
    return PromptLogprobPlan(
        rows=torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True),
        targets=torch.tensor(targets, dtype=torch.int64).to(device, non_blocking=True),
        ks=ks,
        spans=spans,
    )
