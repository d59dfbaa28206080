"""Shared by the sampler tests: a sampling state holding given rows, many draws of one
request, and the chi-square statistic of draws against a distribution."""

from __future__ import annotations

import torch

from replaylm.sampling import SamplingState, sample
from replaylm.sampling_params import SamplingParams

CPU = torch.device("cpu")


def make_state(rows: list[tuple[SamplingParams, int]], device: torch.device = CPU) -> SamplingState:
    """A state whose slot ``i`` holds ``rows[i]`` (params, seed)."""
    state = SamplingState(max(len(rows), 1) + 2, device)
    for slot, (params, seed) in enumerate(rows):
        state.set(slot, params, seed)
    state.flush()
    return state


def draws(logits_row: torch.Tensor, params: SamplingParams, n: int, seed: int = 1234):
    """``n`` draws of one request, each at its own output position, in one batched call."""
    state = make_state([(params, seed)])
    logits = logits_row[None, :].expand(n, -1).contiguous()
    slots = torch.zeros(n, dtype=torch.int64)
    out_pos = torch.arange(n, dtype=torch.int64)
    return sample(logits, slots, out_pos, state)


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson statistic of the draws against ``probs`` over the support ``probs > 0``."""
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    support = expected > 0
    assert counts[~support].sum() == 0, "drew a token outside the expected support"
    return float(((counts[support] - expected[support]) ** 2 / expected[support]).sum())
