"""Graph tiers fitted to a traffic trace (``graph_tiers="auto:TRACE.json"``).

Fixed tier lists (``graphs.tiers``) waste most when traffic clusters just above a tier
(e.g. speculative verify at ``b * (k + 1)`` tokens), which is exactly where a trace-fitted
list puts its tiers. Here: reading a trace into a histogram of per-step token counts
(:func:`load_trace`), the exact dynamic programme that picks at most ``G`` tiers minimising
the expected padded tokens per step (:func:`tiers_from_trace`), and the figures a tier list
scores on a trace (:func:`expected_waste`, :func:`outside_share`).

Pure Python, like ``graphs.tiers``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from replaylm.graphs.tiers import positive_int, round_up

__all__ = [
    "load_trace",
    "tiers_from_trace",
    "expected_waste",
    "outside_share",
]

# --------------------------------------------------------------------------- traces


def _histogram_from_counts(counts: object, source: str) -> dict[int, int]:
    """Histogram of a list of per-step token counts, rejecting anything but ints >= 1."""
    if not isinstance(counts, list):
        raise ValueError(f"{source}: token_counts must be a list, got {type(counts).__name__}")
    hist: dict[int, int] = {}
    for i, n in enumerate(counts):
        if isinstance(n, bool) or not isinstance(n, int):
            raise ValueError(f"{source}: step {i} has token count {n!r}, not an integer")
        if n <= 0:
            raise ValueError(f"{source}: step {i} has token count {n}; counts must be >= 1")
        hist[n] = hist.get(n, 0) + 1
    return hist


def _histogram_from_mapping(raw: object, source: str) -> dict[int, int]:
    """Parse ``{"n": steps, ...}`` (JSON keys are strings) into ``{n: steps}``."""
    if not isinstance(raw, dict):
        raise ValueError(f"{source}: histogram must be an object, got {type(raw).__name__}")
    hist: dict[int, int] = {}
    for key, steps in raw.items():
        try:
            n = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"{source}: histogram key {key!r} is not an integer") from None
        if n <= 0:
            raise ValueError(f"{source}: histogram token count {n}; counts must be >= 1")
        if isinstance(steps, bool) or not isinstance(steps, int):
            raise ValueError(f"{source}: histogram[{key!r}] = {steps!r} is not an integer")
        if steps <= 0:
            raise ValueError(f"{source}: histogram[{key!r}] = {steps}; step counts must be >= 1")
        hist[n] = hist.get(n, 0) + steps  # "8" and "08" both mean 8
    return hist


def load_trace(path: str) -> dict[int, int]:
    """Read a traffic trace and return its histogram ``{token_count: steps}``.

    Accepted JSON shapes:

    * ``[5, 5, 10, ...]``: one token count per step;
    * ``{"token_counts": [5, 5, 10, ...]}``: the same, wrapped;
    * ``{"histogram": {"5": 2, "10": 1}}``: already counted.

    Raises ``FileNotFoundError`` for a missing file and ``ValueError`` for bad JSON, an
    unknown shape, an empty trace, or a token/step count that is not a positive integer.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"traffic trace {path!r} not found")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(
            f"traffic trace {path!r} is not valid JSON: {e.msg} at line {e.lineno} col {e.colno}"
        ) from None
    except UnicodeDecodeError:
        raise ValueError(f"traffic trace {path!r} is not UTF-8 text") from None

    if isinstance(data, list):
        hist = _histogram_from_counts(data, path)
    elif isinstance(data, dict) and "token_counts" in data:
        hist = _histogram_from_counts(data["token_counts"], path)
    elif isinstance(data, dict) and "histogram" in data:
        hist = _histogram_from_mapping(data["histogram"], path)
    else:
        raise ValueError(
            f"traffic trace {path!r}: expected a list of token counts, "
            '{"token_counts": [...]} or {"histogram": {"n": steps}}'
        )
    if not hist:
        raise ValueError(f"traffic trace {path!r} has no steps")
    return hist


# --------------------------------------------------------------------------- fitting


def tiers_from_trace(hist: Mapping[int, int], max_graphs: int, cap: int) -> list[int]:
    """Tiers (at most ``max_graphs``) minimising expected padded tokens on ``hist``.

    Minimises ``sum(hist[n] * (round_up(tiers, n) - n))`` over the steps with
    ``n <= cap``; steps above ``cap`` cannot have a graph whatever we choose, so they
    are left out. The top tier is the largest observed ``n <= cap`` so every such step
    fits. Among optimal lists the one with the fewest graphs is returned (graphs cost
    capture time and memory, so a graph that saves nothing is not worth taking).

    Why only observed values: moving any tier down to the largest observed value it
    serves lowers every affected step's padding and changes nothing else, so some
    optimum uses observed values only. The DP is then over the ``m`` sorted distinct
    values ``v_0 < ... < v_{m-1}``::

        best[g][j] = min over i < j of  best[g-1][i] + cost(i+1, j)
        cost(a, b) = sum_{a<=k<=b} h_k * (v_b - v_k)        (O(1) from prefix sums)

    i.e. the last of ``g`` tiers sits at ``v_j`` and serves ``v_{i+1}..v_j``. That is
    ``O(G * m^2)``; traces of long prompts have thousands of distinct values, so each
    layer is solved by divide and conquer instead: ``cost`` obeys the quadrangle
    inequality (``cost(a,d) + cost(b,c) - cost(a,c) - cost(b,d) = (v_d - v_c) *
    (H_b - H_a) >= 0`` for ``a <= b <= c <= d``), so the best split point is monotone in
    ``j`` and each layer needs ``O(m log m)``. The result is still exact; the tests
    check it against brute force and a plain quadratic DP.
    """
    positive_int(max_graphs, "max_graphs")
    positive_int(cap, "cap")
    for n, steps in hist.items():
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ValueError(f"trace token count {n!r} must be a positive integer")
        if steps < 0:
            raise ValueError(f"trace step count for {n} is negative ({steps})")
    items = sorted((n, s) for n, s in hist.items() if n <= cap and s > 0)
    if not items:
        raise ValueError(f"no step of the trace fits under the cap {cap}: nothing to capture")
    values = [n for n, _ in items]
    m = len(values)
    if m <= max_graphs:
        return values  # one tier per observed size: zero padding

    # Prefix sums: H[k] = steps among v_0..v_{k-1}, S[k] = tokens among them.
    H = [0] * (m + 1)
    S = [0] * (m + 1)
    for k, (n, s) in enumerate(items):
        H[k + 1] = H[k] + s
        S[k + 1] = S[k] + s * n

    def cost(a: int, b: int) -> float:
        """Padding when v_a..v_b all round up to v_b (empty range when a > b: 0)."""
        return values[b] * (H[b + 1] - H[a]) - (S[b + 1] - S[a])

    # layer[j]: least waste covering v_0..v_j with the current number of tiers, top at v_j.
    layer = [cost(0, j) for j in range(m)]
    parents: list[list[int]] = [[-1] * m]  # parents[g-1][j]: previous tier index, -1 = none
    best_g, best_waste = 1, layer[m - 1]

    for g in range(2, max_graphs + 1):
        layer, par = _next_layer(layer, g, cost)
        parents.append(par)
        if layer[m - 1] < best_waste:  # strict: ties keep the smaller graph count
            best_g, best_waste = g, layer[m - 1]

    # Walk the parent pointers back from the top tier.
    tiers: list[int] = []
    j, g = m - 1, best_g
    while j >= 0 and g >= 1:
        tiers.append(values[j])
        j = parents[g - 1][j]
        g -= 1
    tiers.reverse()
    return tiers


def _next_layer(
    prev: list[float], g: int, cost: Callable[[int, int], float]
) -> tuple[list[float], list[int]]:
    """One DP layer: ``cur[j] = min_{i<j} prev[i] + cost(i+1, j)`` with its argmin.

    With ``g`` tiers the top one at ``v_j`` needs ``j >= g-1`` and a split ``i`` in
    ``[g-2, j-1]`` (``prev`` is finite exactly from ``g-2`` on). Divide and conquer on
    ``j``: the leftmost argmin is monotone in ``j`` (quadrangle inequality), so the
    middle ``j``'s argmin bounds the search for both halves.
    """
    m = len(prev)
    cur = [math.inf] * m
    par = [-1] * m
    stack = [(g - 1, m - 1, g - 2, m - 2)]  # (lo, hi, opt_lo, opt_hi); iterative, no recursion
    while stack:
        lo, hi, opt_lo, opt_hi = stack.pop()
        if lo > hi:
            continue
        mid = (lo + hi) // 2
        best, arg = math.inf, -1
        for i in range(opt_lo, min(mid - 1, opt_hi) + 1):
            c = prev[i] + cost(i + 1, mid)
            if c < best:  # strict: keeps the leftmost argmin, the one that is monotone
                best, arg = c, i
        cur[mid], par[mid] = best, arg
        stack.append((lo, mid - 1, opt_lo, arg))
        stack.append((mid + 1, hi, arg, opt_hi))
    return cur, par


def _fit(hist: Mapping[int, int], tiers: Sequence[int]) -> tuple[float, int, int]:
    """(padded tokens, steps that fit, steps that do not) of ``hist`` on ``tiers``."""
    waste = 0.0
    inside = outside = 0
    for n, steps in hist.items():
        t = round_up(tiers, n)
        if t is None:
            outside += steps
        else:
            inside += steps
            waste += steps * (t - n)
    return waste, inside, outside


def expected_waste(hist: Mapping[int, int], tiers: Sequence[int]) -> float:
    """Padded tokens per step, averaged over the steps that fit under the top tier.

    Steps above the top tier run without a graph and pad nothing, so counting them in
    the average would flatter a list that is simply too short; their share is reported
    separately by :func:`outside_share`. ``0.0`` when no step fits.
    """
    waste, inside, _ = _fit(hist, tiers)
    return waste / inside if inside else 0.0


def outside_share(hist: Mapping[int, int], tiers: Sequence[int]) -> float:
    """Fraction of steps above the top tier (they run without a graph); 0.0 if no steps."""
    _, inside, outside = _fit(hist, tiers)
    total = inside + outside
    return outside / total if total else 0.0
