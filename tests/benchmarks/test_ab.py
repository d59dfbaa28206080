"""``benchmarks/ab.py``: variant parsing, interleaving, per-variant flags and checkouts, failure
handling, the summary's medians and changes, and one real bench process on the built-in
default model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import ab  # noqa: E402


def test_parse_variant():
    assert ab.parse_variant("base") == ab.Variant("base")
    assert ab.parse_variant("base=") == ab.Variant("base")
    assert ab.parse_variant("nopdl=--pdl=off") == ab.Variant("nopdl", ("--pdl=off",))
    assert ab.parse_variant("x=--pdl off --rope-in-attention-max-reqs 0") == ab.Variant(
        "x", ("--pdl", "off", "--rope-in-attention-max-reqs", "0"))
    assert ab.parse_variant("old@/tmp/old=") == ab.Variant("old", (), "/tmp/old")
    assert ab.parse_variant(" old @ /tmp/old =--pdl=on") == ab.Variant("old", ("--pdl=on",),
                                                                      "/tmp/old")
    for bad, msg in (("=--pdl=off", "no name"), ("@/tmp/old=", "no name"),
                     ("x@=", "checkout"), ("x='--a", "split"), ("x=--json out", "--json")):
        with pytest.raises(ValueError, match=msg):
            ab.parse_variant(bad)


def test_variant_env_puts_the_checkout_first_with_its_own_cache():
    base = {"PYTHONPATH": "/a", "HOME": "/h", "REPLAYLM_CACHE": "/c"}
    assert ab.variant_env(ab.Variant("v", ("--pdl=off",)), base) == base
    env = ab.variant_env(ab.Variant("old", (), "/tmp/old"), base)
    assert env["PYTHONPATH"] == os.pathsep.join(["/tmp/old", "/a"]) and env["HOME"] == "/h"
    assert env["REPLAYLM_CACHE"] == os.path.join("/c", "ab", "old")
    env = ab.variant_env(ab.Variant("old", (), "/tmp/old"), {})
    assert env["PYTHONPATH"] == "/tmp/old"
    assert Path(env["REPLAYLM_CACHE"]) == Path.home() / ".cache" / "replaylm" / "ab" / "old"


def test_schedule_alternates_the_order():
    a, b, c = (ab.Variant(n) for n in "abc")
    order = [(r, v.name) for r, v in ab.schedule([a, b, c], 3)]
    assert order == [(0, "a"), (0, "b"), (0, "c"), (1, "c"), (1, "b"), (1, "a"),
                     (2, "a"), (2, "b"), (2, "c")]


def _fake_runner(speeds: dict[str, list[float]], seen: list):
    """Writes the JSON a bench run would, from the variant's next speed (< 0: exit 1). The
    variant is told by its ``--tag`` flag."""

    def run(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        name = cmd[cmd.index("--tag") + 1]
        seen.append((name, cmd[cmd.index("decode") + 1:cmd.index("--json")],
                     env.get("PYTHONPATH", "")))
        tok_s = speeds[name].pop(0)
        if tok_s < 0:
            return subprocess.CompletedProcess(cmd, 1, "", "Traceback ...\nValueError: bad")
        rows = [{"mode": "ragged", "batch": 1, "tok_s": tok_s, "graph_nodes": 149},
                {"mode": "ragged", "batch": 8, "tok_s": 8 * tok_s, "graph_nodes": 150}]
        Path(cmd[cmd.index("--json") + 1]).write_text(json.dumps({"rows": rows}))
        return subprocess.CompletedProcess(cmd, 0, "ok", "")

    return run


def test_runs_summary_and_a_failing_variant():
    variants = [ab.Variant("old", ("--tag", "old"), "/tmp/old"),
                ab.Variant("new", ("--tag", "new")),
                ab.Variant("bad", ("--tag", "bad", "--pdl=off"))]
    speeds = {"old": [100.0, 102.0, 98.0], "new": [110.0, 111.0, 109.0], "bad": [-1] * 3}
    seen: list = []
    echoed: list[str] = []
    runs = ab.run_variants(variants, 3, ["--batch-sizes", "1,8"],
                           runner=_fake_runner(speeds, seen), echo=echoed.append)
    assert [s[0] for s in seen] == ["old", "new", "bad", "bad", "new", "old", "old", "new", "bad"]
    # Every process got the shared bench arguments, then its variant's own flags.
    for name, args, pythonpath in seen:
        want = {"old": ["--tag", "old"], "new": ["--tag", "new"],
                "bad": ["--tag", "bad", "--pdl=off"]}[name]
        assert args == ["--batch-sizes", "1,8", *want]
        # Only the checkout variant has its directory first on PYTHONPATH.
        assert pythonpath.split(os.pathsep)[0] == "/tmp/old" if name == "old" \
            else "/tmp/old" not in pythonpath
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


def test_cli_rejects_bad_arguments(capsys, tmp_path):
    for argv, msg in ((["--variant", "a", "--variant", "a="], "must differ"),
                      (["--variant", "a@="], "checkout directory"),
                      (["--variant", f"a@{tmp_path}="], "not a checkout"),
                      (["--variant", "a", "--rounds", "0"], "--rounds"),
                      (["--variant", "a", "--", "--json", "x"], "before '--'")):
        with pytest.raises(SystemExit):
            ab.main(argv)
        assert msg in capsys.readouterr().err


def test_one_real_bench_process(tmp_path, capsys, monkeypatch):
    """A real ``bench decode`` process on the built-in model: this checkout named as a
    variant's directory, with a flag of its own and its own cache directory."""
    monkeypatch.setenv("REPLAYLM_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "ab.json"
    rc = ab.main(["--variant", f"here@{ROOT}=--max-num-seqs 2", "--rounds", "1",
                  "--json", str(out),
                  "--", "--model", "default", "--batch-sizes", "1", "--new-tokens", "4",
                  "--prompt-len", "4", "--repeats", "1"])
    assert rc == 0, capsys.readouterr()
    record = json.loads(out.read_text())
    assert record["variants"]["here"]["args"] == ["--max-num-seqs", "2"]
    assert record["variants"]["here"]["dir"] == str(ROOT)
    assert record["variants"]["here"]["cache"] == str(tmp_path / "cache" / "ab" / "here")
    [line] = record["summary"]
    assert line["variant"] == "here" and line["batch"] == 1 and line["median"] > 0
