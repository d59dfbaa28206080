"""Logprobs of sampled tokens and of prompt tokens, computed on the device.

Logprobs are ``log_softmax`` of the raw model logits: before penalties, logit_bias, min_p and
temperature (vLLM's default "raw logprobs"), so they describe the model, not the sampler.
The device part (``device_logprobs``) has fixed shapes and no host sync; its tensors are copied
to the host with the sampled ids, after the step, behind the same event.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class TokenLogprobs:
    """One position's logprobs: the chosen token's, its rank, and the top-``k`` alternatives.

    ``rank`` is 1 + the number of tokens with a strictly higher logprob. ``top`` maps token id to
    logprob for the ``k`` most likely tokens (``k`` = the request's ``logprobs`` or
    ``prompt_logprobs``; empty when 0), in descending order.
    """

    token_id: int
    logprob: float
    rank: int
    top: dict[int, float] = field(default_factory=dict)


@dataclass
class DeviceLogprobs:
    """Device (then host) tensors for ``L`` rows: chosen logprob, rank, top-k ids and values."""

    token_ids: torch.Tensor  # [L] int64
    logprob: torch.Tensor  # [L] fp32
    rank: torch.Tensor  # [L] int64
    top_ids: torch.Tensor  # [L, k] int64
    top_logprobs: torch.Tensor  # [L, k] fp32

    def to_host(self, pin: bool) -> DeviceLogprobs:
        """Start non-blocking copies to (pinned, if ``pin``) host memory; wait on an event."""
        def copy(t: torch.Tensor) -> torch.Tensor:
            if not pin:
                return t
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            return host

        return DeviceLogprobs(copy(self.token_ids), copy(self.logprob), copy(self.rank),
                              copy(self.top_ids), copy(self.top_logprobs))

    def rows(self, ks: list[int | None]) -> list[TokenLogprobs | None]:
        """Host objects per row; ``ks[i]`` is row ``i``'s top-k (``None``: not requested)."""
        ids = self.token_ids.tolist()
        lps = self.logprob.tolist()
        ranks = self.rank.tolist()
        top_ids = self.top_ids.tolist()
        top_lps = self.top_logprobs.tolist()
        out: list[TokenLogprobs | None] = []
        for i, k in enumerate(ks):
            if k is None:
                out.append(None)
                continue
            top = dict(zip(top_ids[i][:k], top_lps[i][:k]))
            out.append(TokenLogprobs(ids[i], lps[i], ranks[i], top))
        return out


def device_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> DeviceLogprobs:
    """Logprobs of ``token_ids`` ``[L]`` under ``logits`` ``[L, V]`` plus the top ``k`` per row."""
    lp = logits.float().log_softmax(dim=-1)
    chosen = lp.gather(1, token_ids[:, None])
    rank = (lp > chosen).sum(dim=-1) + 1
    top = lp.topk(min(k, lp.shape[-1]), dim=-1)
    return DeviceLogprobs(token_ids, chosen[:, 0], rank, top.indices, top.values)
