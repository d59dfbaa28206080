"""Prompt lookup: draft the continuation of an earlier occurrence of the request's last tokens.

For ``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``, the last ``n`` known
tokens are searched for earlier in the request (prompt and output); the first ``n`` with a
match wins, and among its matches the most recent one followed by at least the length
asked (else the earliest, which has the longest continuation). The draft is what followed
that match, up to the length asked; no match gives an empty draft.

The drafter runs on the host every step for every decoding request, so each request keeps
an index of where each of its n-grams starts, extended by the tokens it gained since the
last call: a proposal costs a few dictionary lookups, not a scan of the request.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from typing import Any
from weakref import WeakKeyDictionary

from replaylm.speculative.protocol import DraftRequest


class NgramIndex:
    """Start positions of every ``n``-gram (``n_min <= n <= n_max``) of a token sequence
    that only grows, for the n-grams ending before its last token."""

    def __init__(self, n_min: int, n_max: int) -> None:
        self.starts: dict[int, dict[tuple[int, ...], list[int]]] = {
            n: {} for n in range(n_min, n_max + 1)}
        self.indexed = 0  # n-grams ending at positions < indexed are in ``starts``

    def extend(self, tokens: Sequence[int]) -> None:
        """Index the n-grams of ``tokens`` that end before its last token."""
        for end in range(self.indexed, len(tokens) - 1):
            for n, table in self.starts.items():
                start = end - n + 1
                if start >= 0:
                    table.setdefault(tuple(tokens[start:end + 1]), []).append(start)
        self.indexed = max(self.indexed, len(tokens) - 1)

    def draft(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens continuing ``tokens`` by its longest earlier repeated suffix
        (``extend`` first)."""
        total = len(tokens)
        for n in sorted((n for n in self.starts if n <= total - 1), reverse=True):
            hits = self.starts[n].get(tuple(tokens[total - n:]))
            if hits:
                i = bisect_right(hits, total - n - k) - 1  # the latest with k tokens after
                start = (hits[i] if i >= 0 else hits[0]) + n
                return list(tokens[start:start + k])
        return []


class NgramDrafter:
    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self._indexes: WeakKeyDictionary[Any, NgramIndex] = WeakKeyDictionary()

    def propose(self, requests: Sequence[DraftRequest], max_lens: Sequence[int]
                ) -> list[list[int]]:
        return [self._draft(r, k) for r, k in zip(requests, max_lens)]

    def _draft(self, req: DraftRequest, k: int) -> list[int]:
        tokens = req.all_token_ids
        if k < 1 or len(tokens) < self.n_min + 1:
            return []
        index = self._indexes.get(req)
        if index is None or index.indexed > len(tokens) - 1:
            index = self._indexes[req] = NgramIndex(self.n_min, self.n_max)
        index.extend(tokens)
        return index.draft(tokens, k)
