"""``benchmarks/graph_update.py`` off the GPU: the driver's update results by name, and the
per-shape totals (a refused update is charged its recapture fallback) and table."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import graph_update  # noqa: E402


def _row(name: str, result: str = "success", **kw) -> dict:
    row = {"graph": name, "capture_s": 0.010, "update_s": 0.001, "instantiate_s": 0.004,
           "update_result": result}
    row["exec_update_s"] = row["capture_s"] + row["update_s"]
    row["recapture_s"] = row["capture_s"] + row["instantiate_s"]
    return row | kw


def test_summary_charges_refused_updates_their_recapture():
    rows = [_row("full:1", update_bit_identical=True), _row("full:2", "topology changed")]
    s = graph_update.summarize("m", rows, audit_s=0.002)
    assert s["graphs"] == 2 and s["updates_refused"] == 1 and s["updates_bit_identical"]
    assert abs(s["exec_update_s"] - (0.011 * 2 + 0.004)) < 1e-12
    assert abs(s["recapture_s"] - 0.028) < 1e-12
    assert abs(s["exec_update_only_s"] - 0.002) < 1e-12
    text = graph_update.table([s])
    assert text.splitlines()[0].count("|") == 8 and "| m | 2 | 0.002 |" in text


def test_a_patched_graph_that_differs_shows_in_the_summary():
    rows = [_row("ragged:16", update_bit_identical=False)]
    assert not graph_update.summarize("m", rows, 0.0)["updates_bit_identical"]
    assert graph_update.UPDATE_RESULTS[2] == "topology changed"
