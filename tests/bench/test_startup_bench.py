"""``replaylm bench startup`` on the built-in default model (CPU): cold and warm starts in
fresh processes, split into phases."""

from __future__ import annotations

import json

from replaylm.bench.startup import PHASES
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
        assert s["capture_s"] > 0 and s["num_graphs"] == 2 and s["kv_sizing_s"] > 0
        assert s["kv_mib"] > 0 and s["weights_mib"] > 0 and s["first_request_s"] > 0
    # The cold start began from an empty cache of its own and left the weights there.
    assert list((caches / "0-ragged" / "replaylm").glob("default-model-seed0/model.safetensors"))
    assert_png(tmp_path / "startup_startup.png")


def test_rejects_unknown_start_kind(capsys):
    assert main(["bench", "startup", "--starts", "tepid"]) == 2
    assert "--starts" in capsys.readouterr().err
