"""Rejection sampling gives the target's distribution exactly (chi-square, tiny vocabulary)."""

from __future__ import annotations

import torch

from replaylm.kernels.counter_rng import seed_key, vocab_hash
from replaylm.sampling.sampler import SamplingState, sample
from replaylm.sampling_params import SamplingParams
from replaylm.speculative.acceptance import emitted_rows, rejection_sample

V, N = 6, 12000


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# 99.9th percentile of chi-square with V - 1 = 5 degrees of freedom.
CHI2_5_999 = 20.52


def test_point_proposal_accepts_with_p_of_draft_and_emits_the_target():
    """The engine's path for n-gram drafts: sample the row as plain decoding does, accept the
    draft iff it equals the sample; the emitted first token must be distributed as p."""
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -1.0])
    temperature = 0.9
    p = torch.softmax(logits / temperature, -1)
    state = SamplingState(N, "cpu")
    for s in range(N):
        state.set(s, SamplingParams(temperature=temperature), seed=1000 + s)
    state.flush()
    slots = torch.arange(N)
    draft = 0  # a point proposal on token 0
    # Two rows per request: row 0 verifies the draft, row 1 would be the bonus.
    rows = logits.repeat(N, 1)
    tokens = sample(rows, slots, torch.zeros(N, dtype=torch.int64), state)
    accepted = tokens == draft
    assert abs(float(accepted.float().mean()) - float(p[draft])) < 4 * (p[draft] * (1 - p[draft]) / N) ** 0.5
    counts = torch.bincount(tokens, minlength=V).float()
    assert _chi2(counts, p) < CHI2_5_999
    # Rejected rows follow the residual: p without the draft, renormalised.
    rest = torch.bincount(tokens[~accepted], minlength=V).float()
    resid = p.clone()
    resid[draft] = 0
    resid /= resid.sum()
    assert rest[draft] == 0
    keep = resid > 0
    assert _chi2(rest[keep], resid[keep]) < CHI2_5_999
    # emitted_rows on such a pair: the bonus row only when the draft was accepted.
    pair = torch.stack([tokens, torch.full_like(tokens, 5)], 1).reshape(-1)
    nxt = torch.stack([torch.full_like(tokens, draft), torch.full_like(tokens, -1)], 1).reshape(-1)
    start = torch.arange(N).repeat_interleave(2) * 2
    em = emitted_rows(pair, nxt, start).reshape(N, 2)
    assert em[:, 0].all() and torch.equal(em[:, 1], accepted)


def test_rejection_sampling_with_a_proposal_distribution():
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(V) * 1.5, -1)
    q = torch.softmax(torch.randn(V) * 1.5, -1)
    g = torch.Generator().manual_seed(1)
    drafts = torch.multinomial(q, N, replacement=True, generator=g)
    keys = torch.tensor([seed_key(7 + i) for i in range(N)])
    accepted, out = rejection_sample(p.repeat(N, 1), q.repeat(N, 1), drafts, keys,
                                     torch.zeros(N, dtype=torch.int64), vocab_hash(V, "cpu"))
    counts = torch.bincount(out, minlength=V).float()
    assert _chi2(counts, p) < CHI2_5_999
    rate = float(torch.minimum(p, q).sum())  # the acceptance probability of the rule
    assert abs(float(accepted.float().mean()) - rate) < 4 * (rate * (1 - rate) / N) ** 0.5
    # A proposal equal to the target is always accepted.
    acc_same, out_same = rejection_sample(p.repeat(N, 1), p.repeat(N, 1), drafts, keys,
                                          torch.zeros(N, dtype=torch.int64),
                                          vocab_hash(V, "cpu"))
    assert acc_same.all() and torch.equal(out_same, drafts)
