"""``replaylm bench startup`` on the built-in default model (CPU): cold and warm starts in
fresh processes, split into phases."""

from __future__ import annotations

import json

from replaylm.bench.startup import PHASES, format_sources, format_table
from replaylm.cli.main import main
from tests.bench.png import assert_png


def test_cold_and_warm_starts_are_split_into_phases(tmp_path):
    out, caches = tmp_path / "startup.json", tmp_path / "caches"
    rc = main(["bench", "startup", "--device", "cpu", "--modes", "ragged", "--graph-tiers", "1,8",
               "--cpu-kv-cache-gib", "0.05", "--load-format", "auto", "--cache-root", str(caches),
               "--json", str(out)])
    assert rc == 0
    starts = json.loads(out.read_text())["starts"]
    assert [(s["mode"], s["start"]) for s in starts] == [("ragged", "cold"), ("ragged", "warm")]
    for s in starts:
        assert s["ready_s"] > 0 and s["process_s"] > s["ready_s"]
        assert abs(sum(s[k] for k in PHASES) - s["ready_s"]) < 1e-2
        assert s["capture_s"] > 0 and s["num_graphs"] == 4 and s["kv_sizing_s"] > 0
        assert s["kv_mib"] > 0 and s["weights_mib"] > 0 and s["first_request_s"] > 0
        # No fused kernels on a CPU: nothing decided, nothing compiled by Triton.
        assert s["decisions"] == {"cache": 0, "shipped": 0, "tuned": 0}
        assert s["tuning"]["candidates_timed"] == 0
        assert set(s["jit"]) == {"tune", "capture", "total"}
        assert s["jit"]["total"] == {"compiled": 0, "compile_s": 0.0, "loaded": 0, "load_s": 0.0}
    # The cold start began from an empty cache of its own and left the weights there.
    assert list((caches / "0-ragged" / "replaylm").glob("default-model-seed0/model.safetensors"))
    assert_png(tmp_path / "startup_startup.png")


def test_rejects_unknown_start_kind(capsys):
    assert main(["bench", "startup", "--starts", "tepid"]) == 2
    assert "--starts" in capsys.readouterr().err


def _gpu_row(decisions, tuning, capture_compiled):
    zero = {"compiled": 0, "compile_s": 0.0, "loaded": 0, "load_s": 0.0}
    capture = {"compiled": capture_compiled, "compile_s": 7.5, "loaded": 2, "load_s": 0.25}
    return {"mode": "ragged", "start": "cold", "ready_s": 20.0, "load_s": 1.0, "compile_ahead_s": 0.0,
            "tune_s": 2.0,
            "kv_sizing_s": 1.0, "capture_s": 9.0, "other_s": 7.0, "first_request_s": 0.5,
            "weights_mib": 2000, "kv_mib": 1000, "graph_mib": 50.0, "num_graphs": 4,
            "import_s": 3.0, "decisions": decisions, "tuning": tuning,
            "jit": {"tune": {**zero, "compiled": 12, "compile_s": 3.0}, "capture": capture,
                    "total": {**capture, "compiled": capture_compiled + 12}}}


def test_start_rows_say_where_decisions_came_from():
    """Each start names its decisions' sources and splits Triton's JIT seconds from capture."""
    shipped = _gpu_row({"cache": 0, "shipped": 36, "tuned": 0},
                       {"precompiled": 20, "precompile_s": 1.5, "candidates_timed": 0,
                        "timing_s": 0.0}, 40)
    text = format_sources(shipped)
    assert text.startswith("kernel decisions: 0 from the user's cache, 36 from the shipped "
                           "table, 0 tuned now (20 kernels compiled ahead in 1.50 s, 0 "
                           "candidates timed in 0.00 s)")
    assert "capture 7.75 s (40 compiled, 2 from disk)" in text
    assert "tune 3.00 s (12 compiled, 0 from disk)" in text
    tuned = _gpu_row({"cache": 0, "shipped": 0, "tuned": 36},
                     {"precompiled": 200, "precompile_s": 9.0, "candidates_timed": 200,
                      "timing_s": 2.0}, 40)
    planned = {**shipped, "compile_ahead_s": 4.25,
               "compile_plan": {"kernels": 30, "skipped": 1, "refused": 0, "source": "h200.json"}}
    assert ("; compile plan h200.json: 30 kernels compiled in 4.25 s (1 skipped, 0 refused)"
            in format_sources(planned))
    table = format_table([shipped, tuned, planned]).splitlines()
    assert table[4].split()[4] == "4.25"  # the compile-ahead column, after weights
    assert "cap JIT" in table[0] and "cache/shipped/tuned" in table[0]
    assert table[2].split()[-1] == "0/36/0" and table[3].split()[-1] == "0/0/36"
    assert "7.75" in table[2].split()
