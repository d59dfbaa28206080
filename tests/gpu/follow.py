"""The bf16 comparison of a parallel engine with one GPU: tokens follow until a near tie."""

from __future__ import annotations

TIE = 0.15  # nats between the reference's top two logprobs where another layout may differ


def assert_follows(want, got) -> None:
    """Each request follows the reference's tokens (their logprobs close) until a near tie,
    and at least 75% of all tokens match."""
    matched = total = 0
    for w, g in zip(want, got):
        n = next((i for i, (a, b) in enumerate(zip(w.token_ids, g.token_ids)) if a != b),
                 len(w.token_ids))
        for i in range(n):  # the chosen tokens' logprobs agree while the tokens do
            assert abs(w.logprobs[i].logprob - g.logprobs[i].logprob) < 0.1, (i, w, g)
        if n < len(w.token_ids):
            top = sorted(w.logprobs[n].top.values(), reverse=True)
            assert top[0] - top[1] < TIE, (n, w.token_ids, g.token_ids, top)
        matched, total = matched + n, total + len(w.token_ids)
    assert matched >= 0.75 * total, (matched, total)
