"""``benchmarks/structured.py --grammar-host``: the host's grammar work per step, on the
built-in default model's vocabulary size (a tokenizer built for it), without a model."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import structured  # noqa: E402
from replaylm.engine.loading import load_model_config  # noqa: E402


def test_grammar_host_times_fill_and_accept_per_row_count():
    vocab = load_model_config("default")[0].vocab_size
    rows = structured.grammar_host(vocab, [1, 3], steps=6)
    assert [r["rows"] for r in rows] == [1, 3]
    assert all(r["fill_ms"] > 0 and r["accept_ms"] > 0 for r in rows)
    # the Python work beside the fill is as long as the fill: neither way takes less
    assert all(r["fill_then_apply_ms"] >= r["fill_ms"] and r["apply_beside_ms"] >= r["fill_ms"]
               for r in rows)
