"""``replaylm.bench.ab``: variant parsing, interleaving, env passing, failure handling, the
summary's medians and changes, and one real bench process on the built-in default model."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from replaylm.bench import ab


def test_parse_variant():
    assert ab.parse_variant("base") == ab.Variant("base", {})
    assert ab.parse_variant("new: A=1, B=x=y") == ab.Variant("new", {"A": "1", "B": "x=y"})
    assert ab.parse_variant("off:REPLAYLM_PDL=") == ab.Variant("off", {"REPLAYLM_PDL": ""})
    for bad in (":A=1", "x:A", "x:=1"):
        with pytest.raises(ValueError, match="variant"):
            ab.parse_variant(bad)


def test_schedule_alternates_the_order():
    a, b, c = (ab.Variant(n) for n in "abc")
    order = [(r, v.name) for r, v in ab.schedule([a, b, c], 3)]
    assert order == [(0, "a"), (0, "b"), (0, "c"), (1, "c"), (1, "b"), (1, "a"),
                     (2, "a"), (2, "b"), (2, "c")]


def _fake_runner(speeds: dict[str, list[float]], seen: list):
    """Writes the JSON a bench run would, from the variant's next speed (FAIL: exit 1)."""

    def run(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        name = env["VARIANT"]
        seen.append((name, cmd[cmd.index("--json") - 2:cmd.index("--json")]))
        tok_s = speeds[name].pop(0)
        if tok_s < 0:
            return subprocess.CompletedProcess(cmd, 1, "", "Traceback ...\nValueError: bad")
        rows = [{"mode": "ragged", "batch": 1, "tok_s": tok_s, "graph_nodes": 149},
                {"mode": "ragged", "batch": 8, "tok_s": 8 * tok_s, "graph_nodes": 150}]
        Path(cmd[cmd.index("--json") + 1]).write_text(json.dumps({"rows": rows}))
        return subprocess.CompletedProcess(cmd, 0, "ok", "")

    return run


def test_runs_summary_and_a_failing_variant():
    variants = [ab.Variant("old", {"VARIANT": "old"}), ab.Variant("new", {"VARIANT": "new"}),
                ab.Variant("bad", {"VARIANT": "bad"})]
    speeds = {"old": [100.0, 102.0, 98.0], "new": [110.0, 111.0, 109.0], "bad": [-1] * 3}
    seen: list = []
    echoed: list[str] = []
    runs = ab.run_variants(variants, 3, ["--batch-sizes", "1,8"],
                           runner=_fake_runner(speeds, seen), echo=echoed.append)
    # Every process got its variant's variables and the shared bench arguments.
    assert [s[0] for s in seen] == ["old", "new", "bad", "bad", "new", "old", "old", "new", "bad"]
    assert all(s[1] == ["--batch-sizes", "1,8"] for s in seen)
    assert all(r.error and "ValueError: bad" in r.error for r in runs if r.variant == "bad")
    assert any("bad" in e and "exit 1" in e for e in echoed)
    lines = ab.summarize(variants, runs)
    by = {(ln.variant, ln.batch): ln for ln in lines}
    assert set(by) == {("old", 1), ("new", 1), ("old", 8), ("new", 8)}
    assert by["old", 1].median == 100.0 and by["old", 1].change is None
    assert by["new", 1].median == 110.0 and by["new", 1].change == pytest.approx(0.10)
    assert by["new", 8].tok_s == [880.0, 888.0, 872.0]
    table = ab.format_lines(lines)
    assert "+10.0%" in table and "149" in table


def test_cli_rejects_bad_arguments(capsys):
    for argv, msg in ((["--variant", "a", "--variant", "a"], "must differ"),
                      (["--variant", "a:B"], "not VAR=VALUE"),
                      (["--variant", "a", "--rounds", "0"], "--rounds"),
                      (["--variant", "a", "--", "--json", "x"], "before '--'")):
        with pytest.raises(SystemExit):
            ab.main(argv)
        assert msg in capsys.readouterr().err


def test_one_real_bench_process(tmp_path, capsys):
    out = tmp_path / "ab.json"
    rc = ab.main(["--variant", "only:REPLAYLM_AB_TEST=1", "--rounds", "1", "--json", str(out),
                  "--", "--model", "default", "--batch-sizes", "1", "--new-tokens", "4",
                  "--prompt-len", "4", "--repeats", "1"])
    assert rc == 0, capsys.readouterr()
    record = json.loads(out.read_text())
    assert record["variants"] == {"only": {"REPLAYLM_AB_TEST": "1"}}
    [line] = record["summary"]
    assert line["variant"] == "only" and line["batch"] == 1 and line["median"] > 0
