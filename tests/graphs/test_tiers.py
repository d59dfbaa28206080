"""Graph tiers: defaults, validation, round-up, traces, and the trace-fitted DP."""

from __future__ import annotations

import itertools
import json
import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replaylm.graphs.tiers import (
    default_decode_tiers,
    default_token_tiers,
    round_up,
    validate_tiers,
)
from replaylm.graphs.tiers_fit import expected_waste, load_trace, outside_share, tiers_from_trace
from replaylm.graphs.tiers_setting import parse_graph_tiers

# --------------------------------------------------------------------------- helpers


def total_waste(hist: dict[int, int], tiers: list[int], cap: int | None = None) -> int:
    """Padded tokens summed over the steps that fit (and are <= cap); exact integers."""
    out = 0
    for n, steps in hist.items():
        if cap is not None and n > cap:
            continue
        t = round_up(tiers, n)
        if t is not None:
            out += steps * (t - n)
    return out


def brute_force(hist: dict[int, int], max_graphs: int) -> tuple[int, int]:
    """(least total waste, fewest graphs reaching it) over every subset of observed values
    of size <= max_graphs that contains the largest value (so every step fits)."""
    values = sorted(hist)
    top, rest = values[-1], values[:-1]
    best: tuple[int, int] | None = None
    for k in range(0, min(max_graphs - 1, len(rest)) + 1):
        for combo in itertools.combinations(rest, k):
            cand = (total_waste(hist, [*combo, top]), k + 1)
            if best is None or cand < best:
                best = cand
    assert best is not None
    return best


def quadratic_dp(hist: dict[int, int], max_graphs: int) -> int:
    """Plain O(G m^2) DP (no divide and conquer): the reference for large histograms."""
    values = sorted(hist)
    m = len(values)

    def cost(a: int, b: int) -> int:
        return sum(hist[values[k]] * (values[b] - values[k]) for k in range(a, b + 1))

    layer = [cost(0, j) for j in range(m)]
    best = layer[-1]
    for _ in range(2, max_graphs + 1):
        layer = [
            min((layer[i] + cost(i + 1, j) for i in range(j)), default=math.inf) for j in range(m)
        ]
        best = min(best, layer[-1])
    return best


histograms = st.dictionaries(
    keys=st.integers(1, 40), values=st.integers(1, 50), min_size=1, max_size=8
)

# --------------------------------------------------------------------------- defaults


def test_default_decode_tiers_shape() -> None:
    tiers = default_decode_tiers(512)
    assert tiers[:5] == [1, 2, 4, 8, 16]
    assert tiers[4:35] == list(range(16, 257, 8))
    assert tiers[35:] == list(range(272, 513, 16))
    assert default_decode_tiers(256)[-1] == 256
    assert default_decode_tiers(1) == [1]
    assert default_decode_tiers(3) == [1, 2, 3]
    assert default_decode_tiers(100) == [1, 2, 4, 8, *range(16, 97, 8), 100]
    # Above the ladder the cap itself is the top tier, so every batch still fits.
    assert default_decode_tiers(1000)[-2:] == [512, 1000]


def test_default_token_tiers_shape() -> None:
    tiers = default_token_tiers(4096)
    assert tiers[:5] == [1, 2, 4, 8, 16]
    assert [t for t in tiers if 512 < t <= 1024] == list(range(576, 1025, 64))
    assert [t for t in tiers if t > 1024] == list(range(1280, 4097, 256))
    assert default_token_tiers(2000)[-2:] == [1792, 2000]


@given(cap=st.integers(1, 5000))
def test_defaults_sorted_capped_and_topped(cap: int) -> None:
    for tiers in (default_decode_tiers(cap), default_token_tiers(cap)):
        assert tiers[0] == 1
        assert tiers[-1] == cap
        assert all(a < b for a, b in zip(tiers, tiers[1:]))
        assert validate_tiers(tiers, limit=cap, what="cap") == tiers
        # Every batch up to the cap has a graph.
        assert round_up(tiers, cap) == cap


@pytest.mark.parametrize("fn", [default_decode_tiers, default_token_tiers])
@pytest.mark.parametrize("bad", [0, -4, True, 2.5])
def test_defaults_reject_bad_caps(fn, bad) -> None:
    with pytest.raises(ValueError, match="must be"):
        fn(bad)


# --------------------------------------------------------------------------- validation


def test_validate_accepts_and_copies() -> None:
    src = (1, 2, 4, 8)
    out = validate_tiers(src, limit=8, what="max_num_seqs")
    assert out == [1, 2, 4, 8] and isinstance(out, list)


@pytest.mark.parametrize(
    ("tiers", "message"),
    [
        ([], "empty"),
        ([1, "2"], "graph tier '2' is not an integer"),
        ([1, 2.0], "graph tier 2.0 is not an integer"),
        ([True, 2], "graph tier True is not an integer"),
        ([0, 1], "graph tier 0 must be positive"),
        ([-3, 1], "graph tier -3 must be positive"),
        ([1, 2, 2, 4], "graph tier 2 is a duplicate"),
        ([1, 8, 4], "unsorted: 4 comes after 8"),
        ([1, 256, 600], "graph tier 600 is above max_graph_tokens=512"),
        ("1,2", "string"),
    ],
)
def test_validate_rejects(tiers, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        validate_tiers(tiers, limit=512, what="max_graph_tokens")


# --------------------------------------------------------------------------- round_up


@pytest.mark.parametrize(
    ("n", "want"), [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8), (9, None), (1000, None)]
)
def test_round_up_boundaries(n: int, want: int | None) -> None:
    assert round_up([1, 2, 4, 8], n) == want


@given(
    tiers=st.lists(st.integers(1, 300), min_size=1, max_size=20, unique=True).map(sorted),
    n=st.integers(1, 320),
)
def test_round_up_is_smallest_covering_tier(tiers: list[int], n: int) -> None:
    covering = [t for t in tiers if t >= n]
    assert round_up(tiers, n) == (min(covering) if covering else None)


# --------------------------------------------------------------------------- traces


def _write(tmp_path, payload, name: str = "trace.json") -> str:
    p = tmp_path / name
    p.write_text(payload if isinstance(payload, str) else json.dumps(payload))
    return str(p)


@pytest.mark.parametrize(
    "payload",
    [
        [5, 5, 10, 1],
        {"token_counts": [5, 5, 10, 1]},
        {"histogram": {"5": 2, "10": 1, "1": 1}},
    ],
)
def test_load_trace_formats(tmp_path, payload) -> None:
    assert load_trace(_write(tmp_path, payload)) == {5: 2, 10: 1, 1: 1}


def test_load_trace_missing_file(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="not found"):
        load_trace(str(tmp_path / "nope.json"))


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ("[1, 2,", "not valid JSON"),
        ([1, 0, 3], "step 1 has token count 0"),
        ([1, -2], "step 1 has token count -2"),
        ([1, 2.5], "not an integer"),
        ({"token_counts": [3, -1]}, "step 1 has token count -1"),
        ({"token_counts": "1,2"}, "must be a list"),
        ({"histogram": {"4": 0}}, "step counts must be >= 1"),
        ({"histogram": {"4": -3}}, "step counts must be >= 1"),
        ({"histogram": {"0": 3}}, "counts must be >= 1"),
        ({"histogram": {"four": 3}}, "key 'four' is not an integer"),
        ({"histogram": []}, "must be an object"),
        ({"steps": [1, 2]}, "expected a list of token counts"),
        ([], "has no steps"),
    ],
)
def test_load_trace_errors(tmp_path, payload, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        load_trace(_write(tmp_path, payload))


# --------------------------------------------------------------------------- the DP


@settings(max_examples=300, deadline=None)
@given(hist=histograms, max_graphs=st.integers(1, 4))
def test_dp_matches_brute_force(hist: dict[int, int], max_graphs: int) -> None:
    tiers = tiers_from_trace(hist, max_graphs, cap=1000)
    least, fewest = brute_force(hist, max_graphs)
    assert total_waste(hist, tiers) == least
    # Ties go to fewer graphs: no optimal list is shorter.
    assert len(tiers) == fewest
    assert tiers[-1] == max(hist)
    assert set(tiers) <= set(hist)
    assert validate_tiers(tiers, limit=1000, what="cap") == tiers


@settings(max_examples=200, deadline=None)
@given(
    hist=histograms,
    max_graphs=st.integers(1, 4),
    others=st.lists(st.integers(1, 60), max_size=4, unique=True),
    top_extra=st.integers(0, 20),
)
def test_dp_never_worse_than_any_covering_list(
    hist: dict[int, int], max_graphs: int, others: list[int], top_extra: int
) -> None:
    # Any list of <= max_graphs tiers, not only observed values, whose top covers the max.
    top = max(hist) + top_extra
    other = sorted({t for t in others if t < top})[: max_graphs - 1]
    rival = [*other, top]
    tiers = tiers_from_trace(hist, max_graphs, cap=1000)
    assert total_waste(hist, tiers) <= total_waste(hist, rival)
    assert expected_waste(hist, tiers) <= expected_waste(hist, rival)


@settings(max_examples=60, deadline=None)
@given(
    hist=st.dictionaries(st.integers(1, 600), st.integers(1, 1000), min_size=1, max_size=50),
    max_graphs=st.integers(1, 10),
)
def test_dp_matches_quadratic_reference(hist: dict[int, int], max_graphs: int) -> None:
    # Larger histograms than brute force can reach: checks the divide-and-conquer layers.
    tiers = tiers_from_trace(hist, max_graphs, cap=10_000)
    assert len(tiers) <= max_graphs
    assert total_waste(hist, tiers) == quadratic_dp(hist, max_graphs)


def test_dp_no_waste_when_budget_covers_every_value() -> None:
    hist = {3: 1, 7: 2, 11: 5}
    assert tiers_from_trace(hist, 3, cap=100) == [3, 7, 11]
    assert tiers_from_trace(hist, 16, cap=100) == [3, 7, 11]


def test_dp_leaves_out_steps_above_cap() -> None:
    hist = {5: 10, 10: 10, 900: 1000}
    tiers = tiers_from_trace(hist, 4, cap=512)
    assert tiers == [5, 10]
    assert outside_share(hist, tiers) == pytest.approx(1000 / 1020)
    # The average is over the steps that fit, so the 900s do not dilute it.
    assert expected_waste(hist, [10]) == pytest.approx(2.5)


def test_dp_errors() -> None:
    with pytest.raises(ValueError, match="nothing to capture"):
        tiers_from_trace({600: 3}, 4, cap=512)
    with pytest.raises(ValueError, match="max_graphs"):
        tiers_from_trace({6: 3}, 0, cap=512)
    with pytest.raises(ValueError, match="positive integer"):
        tiers_from_trace({0: 3}, 2, cap=512)


def test_dp_scales_to_many_distinct_values() -> None:
    # Long-prompt traces have thousands of distinct sizes; this must stay interactive.
    hist = {n: 1 + (n * 7919) % 13 for n in range(1, 4001)}
    tiers = tiers_from_trace(hist, 16, cap=8192)
    assert len(tiers) == 16 and tiers[-1] == 4000


def test_auto_tiers_beat_defaults_by_a_wide_margin() -> None:
    # Chunked prefill: 1024-token chunks with 1..8 decodes riding along, plus pure decode
    # batches. Defaults pad every 1024+b step to 1280 (~250 tokens); eight fitted graphs
    # (the defaults use 63) cut the average padding by far more than 5x.
    hist = {b: 100 for b in range(1, 9)} | {1024 + b: 20 for b in range(1, 9)}
    defaults = default_token_tiers(2048)
    auto = tiers_from_trace(hist, 8, cap=2048)
    assert len(auto) <= 8 < len(defaults)
    assert expected_waste(hist, defaults) > 40
    assert expected_waste(hist, auto) * 5 < expected_waste(hist, defaults)


def test_expected_waste_and_outside_share() -> None:
    hist = {3: 2, 5: 1, 9: 1}
    # 3->4 twice (2), 5->8 (3); 9 is outside. 5 padded tokens over 3 steps that fit.
    assert expected_waste(hist, [1, 2, 4, 8]) == pytest.approx(5 / 3)
    assert outside_share(hist, [1, 2, 4, 8]) == pytest.approx(0.25)
    assert expected_waste({20: 4}, [8]) == 0.0
    assert outside_share({}, [8]) == 0.0


# --------------------------------------------------------------------------- CLI spec


def test_parse_none_gives_default() -> None:
    tiers, report = parse_graph_tiers(None, default=[1, 2, 4], limit=4, max_graphs=None)
    assert tiers == [1, 2, 4] and "3 graphs" in report


def test_parse_list() -> None:
    tiers, _ = parse_graph_tiers(" 1, 2,4 ,8", default=[1], limit=8, max_graphs=None)
    assert tiers == [1, 2, 4, 8]


@pytest.mark.parametrize(
    ("spec", "kwargs", "message"),
    [
        ("1,,2", {}, "comma-separated integers"),
        ("", {}, "comma-separated integers"),
        ("1,x", {}, "graph tier 'x' is not an integer"),
        ("1,4,2", {}, "unsorted"),
        ("1,600", {"what": "max_graph_tokens"}, "graph tier 600 is above max_graph_tokens=512"),
        ("1,2,4", {"max_graphs": 2}, "3 graph tiers given but max_graphs=2"),
        ("auto:", {}, "needs a trace file"),
    ],
)
def test_parse_errors(spec: str, kwargs: dict, message: str) -> None:
    args = {"default": [1, 2], "limit": 512, "max_graphs": None} | kwargs
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_graph_tiers(spec, **args)


def test_parse_auto(tmp_path) -> None:
    path = _write(tmp_path, {"histogram": {str(5 * b): 10 for b in range(1, 41)} | {"900": 5}})
    defaults = default_token_tiers(512)
    tiers, report = parse_graph_tiers(f"auto:{path}", default=defaults, limit=512, max_graphs=None)
    assert len(tiers) == 16 and tiers[-1] == 200  # unset budget: 16 graphs
    m = re.match(
        rf"tiers from {re.escape(path)}: 16 graphs, expected waste (\d+\.\d) tokens/step "
        rf"vs (\d+\.\d) with the defaults \({len(defaults)} graphs\)",
        report,
    )
    assert m, report
    assert "1.2% of steps run without a graph" in report  # the 5 steps of 900 > 512
    tiers4, _ = parse_graph_tiers(f"auto:{path}", default=defaults, limit=512, max_graphs=4)
    assert len(tiers4) == 4


def test_parse_auto_missing_trace(tmp_path) -> None:
    with pytest.raises(FileNotFoundError):
        parse_graph_tiers(f"auto:{tmp_path / 'x.json'}", default=[1], limit=8, max_graphs=None)


def test_speculative_engines_get_verify_tiers() -> None:
    """Verify steps of a few requests hold any token count: with speculation on, every size
    to 16 and step 4 to 64 is a tier (a given tier list is left as given)."""
    from replaylm.graphs.policy import GraphPolicy
    from replaylm.graphs.tiers import verify_token_tiers

    kw = dict(graph_tiers=None, max_graph_tokens=512, max_graphs=None, max_num_seqs=64,
              max_num_batched_tokens=512)
    plain = GraphPolicy.resolve("ragged", **kw).token_tiers
    spec = GraphPolicy.resolve("ragged", speculative=True, **kw).token_tiers
    assert 3 not in plain and 20 not in plain
    assert spec == sorted(set(plain) | set(range(1, 17)) | set(range(20, 65, 4)))
    assert verify_token_tiers(10) == list(range(1, 11))
    given = GraphPolicy.resolve("ragged", speculative=True, **(kw | {"graph_tiers": "1,8,64"}))
    assert given.token_tiers == [1, 8, 64]
