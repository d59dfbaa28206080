"""``benchmarks/strategy_table.py``: the section it writes into docs/benchmarks.md, from a real
tiny run of every bench command on the built-in default model (CPU)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import strategy_table as st  # noqa: E402
from tests.bench.png import assert_png  # noqa: E402

DOC = f"# Benchmarks\n\nBefore.\n\n{st.BEGIN}\nstale\n{st.END}\n\n## After\n\nKept.\n"


def test_replace_section_keeps_the_rest_and_appends_without_markers():
    section = f"{st.BEGIN}\nnew\n{st.END}\n"
    once = st.replace_section(DOC, section)
    assert "stale" not in once and "new" in once
    assert once.startswith("# Benchmarks\n\nBefore.\n\n") and once.endswith("## After\n\nKept.\n")
    assert st.replace_section(once, section) == once
    appended = st.replace_section("# Other\n", section)
    assert appended == "# Other\n\n" + section


def test_findings_name_the_leader_and_its_margin():
    decode = {"big": 256, "b1": {"eager": 100.0, "ragged": 800.0, "full": 790.0},
              "bN": {"eager": 1000.0, "ragged": 9000.0, "full": 9500.0},
              "pad": {"ragged": 0.02, "full": 0.3},
              "graphs": {"eager": {"num_graphs": 0},
                         "ragged": {"num_graphs": 51, "capture_seconds": 2.9, "graph_mib": 68.0},
                         "full": {"num_graphs": 35, "capture_seconds": 1.6, "graph_mib": 32.0}}}
    serve = {"tok": {"ragged": 5000.0, "full": 4000.0}, "itl": {"ragged": 9.0, "full": 7.5},
             "rate": "16"}
    text = "\n".join(st.findings(decode, serve))
    assert "batch 1: `ragged` leads with 800.0 tok/s, 8.0× eager" in text
    assert "256 requests: `full` leads with 9,500.0 tok/s, 9.5× eager" in text
    assert "Least padding at 256 requests among graph modes: `ragged` (2.0%" in text
    assert "Fewest graphs: `full` (35)" in text
    assert "`ragged` has the most output tok/s (5,000.0); `full` the lowest p99 ITL (7.50 ms)" in text


def test_tiny_run_regenerates_the_section(tmp_path):
    out, doc = tmp_path / "results", tmp_path / "docs" / "benchmarks.md"
    doc.parent.mkdir()
    doc.write_text(DOC)
    assert st.main(["--tiny", "--modes", "eager,ragged", "--out", str(out), "--docs", str(doc),
                    "--in-process"]) == 0
    for part in st.PARTS:
        assert (out / f"{part}.json").exists(), part
    text = doc.read_text()
    assert text.count(st.BEGIN) == 1 and "stale" not in text
    assert text.startswith("# Benchmarks\n\nBefore.\n\n") and text.endswith("## After\n\nKept.\n")
    assert "not GPU figures" in text
    assert re.search(r"\| `eager` \| [\d,.]+ \| [\d.]+ \| [\d,.]+ \|", text)
    # two tiers, each a step graph and its tail graph
    assert re.search(r"\| `ragged` \| [\d,.]+ \| [\d.]+ \| [\d,.]+ \| [\d.]+ \| [\d.]+% \| 4 \|",
                     text)
    assert "Serving, Poisson arrivals at 20 req/s" in text
    assert re.search(r"\| `ragged` \| cold \| [\d.]+ \| [\d.]+ \| 0\.00 \| ", text)  # no plan on CPU
    assert "| HF `generate` | 1 |" in text
    assert "Decode, batch 1: `" in text
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert "../results/profile/timeline_b1.png" in images and len(images) == 8
    for image in images:
        assert_png(doc.parent / image)
    # Rendering again from the same JSON gives the same section, with the commands that
    # were run even when this call's arguments would make others.
    assert st.main(["--tiny", "--modes", "eager,ragged", "--out", str(out), "--docs", str(doc),
                    "--skip-run", "--rates", "20,40,inf", "--num-requests", "9"]) == 0
    assert doc.read_text() == text


def test_the_docs_hold_one_section_to_rewrite():
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    assert text.count(st.BEGIN) == 1 and text.count(st.END) == 1
    assert text.index(st.BEGIN) < text.index(st.END)
