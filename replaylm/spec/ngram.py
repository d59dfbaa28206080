"""Prompt lookup: draft the continuation of an earlier occurrence of the request's last tokens.

For ``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``, the last ``n`` known
tokens are searched for earlier in the request (prompt and output); the first ``n`` with a
match wins, and among its matches the most recent one followed by at least the length
asked (else the earliest, which has the longest continuation). The draft is what followed
that match, up to the length asked; no match gives an empty draft.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from replaylm.spec.drafter import DraftRequest


def ngram_draft(tokens: Sequence[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to ``k`` tokens continuing ``tokens`` by its longest earlier repeated suffix."""
    total = len(tokens)
    if k < 1 or total < n_min + 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(n_max, total - 1), n_min - 1, -1):
        suffix = arr[total - n:]
        # Windows starting at 0 .. total - n - 1: every earlier occurrence (overlaps allowed).
        windows = sliding_window_view(arr[: total - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            whole = hits[hits + n + k <= total]
            start = int(whole[-1] if len(whole) else hits[0]) + n
            return arr[start: start + k].tolist()
    return []


class NgramDrafter:
    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max

    def propose(self, requests: Sequence[DraftRequest], max_lens: Sequence[int]
                ) -> list[list[int]]:
        return [ngram_draft(r.all_token_ids, k, self.n_min, self.n_max)
                for r, k in zip(requests, max_lens)]
