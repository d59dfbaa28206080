"""Graph tiers: the padded sizes CUDA graphs are captured for.

A captured graph has fixed shapes, so a step of ``n`` real rows (requests for the
``full`` mode, tokens for the token-keyed ``piecewise`` / ``ragged`` modes) replays the
smallest graph whose tier is ``>= n`` and pads the difference (:func:`round_up`). Above
the top tier a step runs without a graph; that is slower but never an error.

Two ways to pick tiers:

* fixed defaults in the spirit of vLLM and SGLang (dense at the bottom, where decode
  batches live and where one padded row is a large relative cost, sparser higher up):
  this module, with the check of a hand-written list (:func:`validate_tiers`);
* tiers fitted to a traffic trace: under a budget of ``G`` graphs, an exact dynamic
  programme minimises the expected padded tokens per step (``graphs.tiers_fit``).

``graphs.tiers_setting`` turns the ``graph_tiers`` setting into one of these lists.

Pure Python on purpose: the runtime, the CLI and the benchmarks all import it, and none
of it should need torch or a GPU to be tested.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence

__all__ = [
    "default_decode_tiers",
    "default_token_tiers",
    "verify_token_tiers",
    "validate_tiers",
    "round_up",
]

# Sizes every default list starts with: batch 1..8 decode is the common case, and padding
# batch 3 to 8 would waste more than the extra graphs cost.
_SMALL = (1, 2, 4, 8)


def positive_int(value: object, name: str) -> int:
    """Return ``value`` if it is a positive int (bool excluded), else raise ValueError."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def _ladder(cap: int, steps: Iterable[tuple[int, int]]) -> list[int]:
    """Small dense sizes, then each ``(step, end)`` segment, capped at ``cap``.

    The top tier is always ``cap`` itself, so every batch the engine can form (it never
    forms one above ``cap``) has a graph.
    """
    tiers = list(_SMALL)
    for step, end in steps:
        start = tiers[-1] + step
        tiers.extend(range(start, end + 1, step))
    capped = [t for t in tiers if t <= cap]
    if not capped or capped[-1] != cap:
        capped.append(cap)
    return capped


def default_decode_tiers(max_num_seqs: int) -> list[int]:
    """Default batch-size tiers for the ``full`` (uniform decode) mode.

    ``1, 2, 4, 8, 16, 24, ..., 256`` (step 8), then ``272, ..., 512`` (step 16), cut at
    ``max_num_seqs`` and topped with ``max_num_seqs`` itself. Close to vLLM's
    ``[1, 2, 4] + 8..248/8 + 256..512/16`` and SGLang's ``[1, 2, 4, 8, 12] + 16..256/8``.
    """
    positive_int(max_num_seqs, "max_num_seqs")
    return _ladder(max_num_seqs, [(8, 256), (16, 512)])


def default_token_tiers(max_graph_tokens: int) -> list[int]:
    """Default total-token tiers for the token-keyed modes (``piecewise``, ``ragged``).

    Same bottom as the decode tiers, then step 8 to 256, step 16 to 512, step 64 to 1024
    and step 256 beyond, cut at ``max_graph_tokens`` and topped with it. The spacing grows
    with size so the relative padding stays roughly bounded (<= 25% past 1024) while the
    graph count stays in the tens.
    """
    positive_int(max_graph_tokens, "max_graph_tokens")
    return _ladder(max_graph_tokens, [(8, 256), (16, 512), (64, 1024), (256, max_graph_tokens)])


def verify_token_tiers(max_graph_tokens: int) -> list[int]:
    """Token tiers added to the defaults when speculative decoding is on: a verify step of a
    few requests holds any number of tokens (each request one plus its drafts), so every
    size to 16 and step 4 to 64 get a graph, and such steps pad at most 3 tokens."""
    positive_int(max_graph_tokens, "max_graph_tokens")
    return [t for t in (*range(1, 17), *range(20, 65, 4)) if t <= max_graph_tokens]


def validate_tiers(tiers: Sequence[int], *, limit: int, what: str) -> list[int]:
    """Check a user-given tier list and return it as a fresh ``list[int]``.

    ``what`` names the limit in messages (e.g. ``"max_graph_tokens"``), so a user sees
    which setting a tier collides with. Tiers must be strictly increasing: a silent sort
    or dedup would hide a typo in a hand-written list.
    """
    if isinstance(tiers, (str, bytes)):
        # A string is a Sequence; iterating it would give characters, not tiers.
        raise ValueError(f"graph tiers must be a list of integers, got the string {tiers!r}")
    out = list(tiers)
    if not out:
        raise ValueError("graph tiers are empty: give at least one tier")
    for t in out:
        if isinstance(t, bool) or not isinstance(t, int):
            raise ValueError(f"graph tier {t!r} is not an integer")
        if t <= 0:
            raise ValueError(f"graph tier {t} must be positive")
    for prev, cur in zip(out, out[1:]):
        if cur == prev:
            raise ValueError(f"graph tier {cur} is a duplicate (tiers must be strictly increasing)")
        if cur < prev:
            raise ValueError(
                f"graph tiers are unsorted: {cur} comes after {prev} "
                "(tiers must be strictly increasing)"
            )
    if out[-1] > limit:
        raise ValueError(f"graph tier {out[-1]} is above {what}={limit}")
    return out


def round_up(tiers: Sequence[int], n: int) -> int | None:
    """Smallest tier ``>= n``; ``None`` when ``n`` is above the top tier (run eagerly).

    ``tiers`` must be sorted ascending (as every function here returns them).
    """
    i = bisect.bisect_left(tiers, n)
    return tiers[i] if i < len(tiers) else None
