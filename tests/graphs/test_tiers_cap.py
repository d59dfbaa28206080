"""Graph tiers at exactly the cap: a step of ``n == cap`` tokens is graphable, so the fitted
tier list must serve it (a mutation of ``n <= cap`` to ``n < cap`` must fail here)."""

from __future__ import annotations

import json

import pytest

from replaylm.graphs.tiers import round_up, validate_tiers
from replaylm.graphs.tiers_fit import expected_waste, outside_share, tiers_from_trace
from replaylm.graphs.tiers_setting import parse_graph_tiers


def test_a_trace_of_steps_at_the_cap_alone() -> None:
    assert tiers_from_trace({64: 5}, 4, cap=64) == [64]


def test_one_tier_per_size_keeps_the_cap() -> None:
    assert tiers_from_trace({3: 2, 17: 1, 64: 4}, 8, cap=64) == [3, 17, 64]
    assert tiers_from_trace({3: 2, 17: 1, 64: 4, 65: 9}, 8, cap=64) == [3, 17, 64]


@pytest.mark.parametrize("max_graphs", [1, 2, 3])
def test_fitted_tiers_top_out_at_a_step_of_cap_tokens(max_graphs) -> None:
    """More distinct sizes than graphs (the DP), the largest observed step exactly at cap."""
    hist = {1: 40, 2: 30, 3: 20, 5: 10, 9: 6, 20: 3, 32: 2}
    tiers = tiers_from_trace(hist, max_graphs, cap=32)
    assert tiers[-1] == 32 and len(tiers) <= max_graphs
    assert round_up(tiers, 32) == 32
    assert outside_share(hist, tiers) == 0.0
    assert tiers_from_trace({**hist, 33: 50}, max_graphs, cap=32) == tiers  # above: left out


def test_auto_spec_with_a_step_at_the_limit(tmp_path) -> None:
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps([1, 1, 2, 4, 4, 8, 16, 16, 16]))
    tiers, report = parse_graph_tiers(f"auto:{trace}", default=[1, 2, 4, 8, 16], limit=16,
                                      max_graphs=3, what="max_graph_tokens")
    assert tiers[-1] == 16 and "run without a graph" not in report
    assert expected_waste({16: 3}, tiers) == 0


def test_a_given_tier_equal_to_the_limit_is_valid() -> None:
    assert validate_tiers([1, 8, 16], limit=16, what="max_graph_tokens") == [1, 8, 16]
    with pytest.raises(ValueError, match="above max_graph_tokens=16"):
        validate_tiers([1, 8, 17], limit=16, what="max_graph_tokens")
