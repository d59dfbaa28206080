"""``replaylm bench decode``'s JSON, PNG plots, step timelines and the transformers peer,
on the built-in default model (CPU, tiny settings)."""

from __future__ import annotations

import json

from replaylm.bench.peer_hf import ratios
from replaylm.cli.main import main
from tests.bench.png import assert_png

TINY = ["--model", "default", "--device", "cpu", "--new-tokens", "4", "--prompt-len", "6",
        "--batched-prompt-len", "6", "--repeats", "1", "--graph-tiers", "1,8",
        "--batched-repeats", "2", "--min-seconds", "0"]


def test_decode_writes_json_plots_timelines_and_peer_ratios(tmp_path, capsys):
    out, prof = tmp_path / "decode.json", tmp_path / "prof"
    rc = main(["bench", "decode", *TINY, "--batch-sizes", "1,3", "--modes", "eager,ragged",
               "--profile", str(prof), "--peer", "hf", "--peer-hf-modes", "generate",
               "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "replaylm ragged / hf generate, batch 1" in text
    record = json.loads(out.read_text())
    rows = {(r["mode"], r["batch"]): r for r in record["rows"]}
    assert set(rows) == {("eager", 1), ("eager", 3), ("ragged", 1), ("ragged", 3)}
    # 3 requests in a tier of 8 tokens: 5 of every 8 decode tokens are padding.
    assert rows[("ragged", 3)]["padding_share"] > 0.5
    assert rows[("eager", 3)]["padding_share"] == 0.0
    for r in rows.values():
        assert 0 < r["step_ms_p50"] <= r["step_ms_p99"]
    for mode in ("eager", "ragged"):  # one wave of 3 per repeat, 2 repeats, every step kept
        row = rows[(mode, 3)]
        assert row["requests"] == 3 and len(row["all_tok_s"]) == 2
        assert row["tok_s_spread"]["min"] <= row["tok_s"] <= row["tok_s_spread"]["max"]
        assert sum(s["decode_tokens"] for s in row["steps"]) >= 3 * 3
        assert row["tail"]["steps"] >= 1
    assert "3 requests per repeat, 2 repeats" in text
    peers = record["peers"]
    assert [(p["mode"], p["batch"]) for p in peers] == [("generate", 1), ("generate", 3)]
    assert all(p["tok_s"] > 0 and p["generated_tokens"] == 4 * p["batch"] and not p["error"]
               for p in peers)
    assert record["ratios"] == ratios(record["rows"], peers)
    assert len(record["ratios"]) == 4
    for suffix in ("throughput", "padding", "capture"):
        assert_png(tmp_path / f"decode_{suffix}.png")
    for bs in (1, 3):
        assert_png(prof / f"timeline_b{bs}.png")
        steps = json.loads((prof / f"ragged_b{bs}.steps.json").read_text())
        tl = steps["timeline"]
        assert tl["source"] == "host" and tl["kernels"] > 10
        assert 0 <= tl["gap_share"] < 1
        assert abs(tl["busy_us"] + tl["gap_us"] - tl["window_us"]) < 1e-2


def test_ratios_pair_rows_with_peers_of_the_same_batch():
    rows = [{"mode": "ragged", "batch": 1, "tok_s": 300.0},
            {"mode": "ragged", "batch": 8, "tok_s": 800.0}]
    peers = [{"peer": "hf", "mode": "generate", "batch": 1, "tok_s": 100.0, "error": None},
             {"peer": "hf", "mode": "generate_batch", "batch": 1, "tok_s": None,
              "error": "unavailable"}]
    assert ratios(rows, peers) == [{"mode": "ragged", "batch": 1, "peer": "hf generate",
                                    "ratio": 3.0}]
