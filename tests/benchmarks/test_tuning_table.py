"""``benchmarks/tuning_table.py build``: measured caches into the shipped tables (current
kernel revision only, one file per GPU, merged with the table there, later inputs winning),
read back by the engine's own lookup; bad inputs named; the tables are package data."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import tuning_table  # noqa: E402

REV = "0123456789ab"
OLD = "ba9876543210"
H200, A100 = "NVIDIA H200", "NVIDIA A100-SXM4-80GB"


def key(gpu: str, shape: str, rev: str = REV, torch_version: str | None = None,
        pdl: str | None = None) -> str:
    """An entry key with this process's torch/Triton/PDL (so the engine's lookup can hit it)."""
    import torch
    import triton

    from replaylm.kernels import pdl as pdl_mod

    return (f"{gpu}|torch {torch_version or torch.__version__}|triton {triton.__version__}|"
            f"pdl {pdl or pdl_mod.mode()}|src {rev}|{shape}")


S1 = "plain|1x4096x1024|torch.bfloat16|False"
S2 = "norm|2x4096x1024|torch.bfloat16|False"
S3 = "silu|1x1024x3072|torch.bfloat16|False"


def write(path: Path, entries: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(entries))
    return path


def test_merge_keeps_the_current_revision_and_lets_later_inputs_win():
    table = {key(H200, S1): [[1, 4, 1024, 4], 3.0, 4.0], key(H200, S2, rev=OLD): [None, 5, 5],
             key(H200, S3): [None, 3.6, 3.6]}
    first = {key(H200, S1): [[1, 8, 512, 4], 2.9, 4.0], key(H200, S2): [None, 5.1, 5.1],
             key(H200, S2, rev=OLD): [[2, 4, 256, 4], 4.0, 5.0]}
    second = {key(H200, S2): [[2, 4, 256, 4], 4.9, 5.1]}
    merged, report = tuning_table.merge(table, [first, second], REV)
    assert merged == {key(H200, S1): [[1, 8, 512, 4], 2.9, 4.0],
                      key(H200, S2): [[2, 4, 256, 4], 4.9, 5.1],
                      key(H200, S3): [None, 3.6, 3.6]}
    assert report == tuning_table.MergeReport(kept=1, added=1, replaced=1, changed=2,
                                              dropped_stale=1)


def test_build_writes_one_table_per_gpu_that_the_engine_reads(tmp_path):
    from replaylm.kernels.tuning_cache import TuningCache, shipped_path

    tables = tmp_path / "tuned"
    tables.mkdir()
    write(shipped_path(H200, tables), {key(H200, S3): [None, 3.6, 3.6],
                                       key(H200, S3, rev=OLD): [None, 1, 1]})
    a = write(tmp_path / "a.json", {key(H200, S1): [[1, 8, 512, 4], 2.9, 4.0],
                                    key(A100, S1): [None, 6.0, 6.0],
                                    key(H200, S2, rev=OLD): [None, 5, 5]})
    # A split-K decision has a fifth entry, the number of K ranges.
    b = write(tmp_path / "b.json", {key(H200, S2): [[2, 4, 256, 4, 2], 4.9, 5.1]})
    lines = []
    reports = tuning_table.build([a, b], tables, REV, log=lines.append)
    assert sorted(reports) == ["nvidia-a100-sxm4-80gb.json", "nvidia-h200.json"]
    assert any("a.json: 1 of 3 entries are for another kernel revision" in x for x in lines)
    h200 = json.loads(shipped_path(H200, tables).read_text())
    assert sorted(h200) == sorted([key(H200, S1), key(H200, S2), key(H200, S3)])
    assert json.loads(shipped_path(A100, tables).read_text()) == {key(A100, S1): [None, 6.0, 6.0]}

    import torch

    shape = ("norm", 2, 4096, 1024, torch.bfloat16, False)
    table = TuningCache(REV, shipped_path(H200, tables), read_only=True)
    assert table.lookup(shape, H200) == ((2, 4, 256, 4, 2), 4.9, 5.1)
    assert table.lookup(shape, A100) is None
    assert TuningCache(OLD, shipped_path(H200, tables), read_only=True).lookup(shape, H200) is None

    before = shipped_path(H200, tables).read_text()
    tuning_table.build([b], tables, REV, dry_run=True, log=lines.append)  # writes nothing
    assert shipped_path(H200, tables).read_text() == before


def test_build_refuses_inputs_without_current_entries_and_names_bad_files(tmp_path):
    stale = write(tmp_path / "stale.json", {key(H200, S1, rev=OLD): [None, 1.0, 1.0]})
    with pytest.raises(ValueError, match="no entry of kernel revision"):
        tuning_table.build([stale], tmp_path / "tuned", REV, log=lambda _: None)
    bad = write(tmp_path / "bad.json", {key(H200, S1): [[1, 4], 1.0, 1.0]})
    with pytest.raises(ValueError, match=r"bad\.json: entry .* is not \[config"):
        tuning_table.build([bad], tmp_path / "tuned", REV, log=lambda _: None)
    (tmp_path / "text.json").write_text("not json")
    with pytest.raises(ValueError, match=r"text\.json: not JSON"):
        tuning_table.build([tmp_path / "text.json"], tmp_path / "tuned", REV, log=lambda _: None)
    assert tuning_table.main(["build", str(stale), "--table-dir", str(tmp_path / "t")]) == 2
    assert not (tmp_path / "t").exists()


def test_shipped_tables_are_package_data():
    """The tables directory is where the engine looks, and pyproject packages its JSON."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    from replaylm.kernels.tuning_cache import SHIPPED_DIR

    assert SHIPPED_DIR == ROOT / "replaylm" / "kernels" / "tuned"
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    package_data = data["tool"]["setuptools"]["package-data"]["replaylm"]
    assert "kernels/tuned/*.json" in package_data
    from replaylm.kernels.compile_plan import SHIPPED_DIR as PLANS

    assert PLANS == SHIPPED_DIR / "compile_plans"
    assert "kernels/tuned/compile_plans/*.json" in package_data
    for table in SHIPPED_DIR.glob("*.json"):  # every shipped table is a valid cache
        tuning_table.read_cache(table)


def test_winners_count_tiles_per_row_block(tmp_path, capsys):
    entries = {key(H200, S1): [[1, 8, 512, 4], 2.9, 4.0],
               key(H200, "norm|1x2048x2048|torch.bfloat16|False"): [[1, 8, 512, 4], 3.0, 4.0],
               key(H200, S2): [None, 5.1, 5.1],
               key(H200, "plain|3x4096x1024|torch.bfloat16|False"): [[4, 4, 256, 8], 4.0, 5.0]}
    counts = tuning_table.winners([entries])
    assert counts == {1: {"8x512/4": 2}, 2: {"unfused": 1}, 4: {"4x256/8": 1}}
    assert tuning_table.format_winners(counts) == [
        "BLOCK_M 1: 8x512/4 2", "BLOCK_M 2: unfused 1", "BLOCK_M 4: 4x256/8 1"]
    path = write(tmp_path / "c.json", entries)
    assert tuning_table.main(["winners", str(path)]) == 0
    assert "BLOCK_M 1: 8x512/4 2" in capsys.readouterr().out


def test_measure_starts_each_model_without_the_table_and_keeps_its_cache(tmp_path, monkeypatch):
    """``measure``: one start per model from empty caches with the shipped table off; the
    tuning cache it wrote lands in OUT/<model>.linear_tuning.json, a start that wrote none
    is reported as failed."""
    from replaylm.bench import startup
    from replaylm.config import EngineArgs

    seen = []

    def fake_start(args, cache, timeout):
        seen.append((args.model, args.shipped_tuning_table, args.load_format, list(cache.iterdir())))
        if args.model != "llama3-8b":
            write(cache / "replaylm" / "linear_tuning.json", {key(H200, S1): [None, 1.0, 1.0]})
        return {"ready_s": 9.0, "tune_s": 5.0, "decisions": {"cache": 0, "shipped": 0,
                                                             "tuned": 1},
                "tuning": {"candidates_timed": 10}}

    monkeypatch.setattr(startup, "start_in_child", fake_start)
    out = tmp_path / "out"
    rows = tuning_table.measure(["qwen3-0.6b", "llama3-8b"], out,
                                EngineArgs(load_format="dummy"), 60, log=lambda _: None)
    assert seen == [("qwen3-0.6b", False, "dummy", []), ("llama3-8b", False, "dummy", [])]
    assert json.loads((out / "qwen3-0.6b.linear_tuning.json").read_text()) == {
        key(H200, S1): [None, 1.0, 1.0]}
    assert "error" not in rows[0] and "no tuning cache" in rows[1]["error"]
    assert json.loads((out / "measure.json").read_text())["starts"] == rows


def test_plans_starts_each_model_with_the_table_and_keeps_its_plan(tmp_path, monkeypatch,
                                                                   capsys):
    """``plans``: one start per model from empty caches with the shipped tables on, as a
    user's first start; the plan it recorded lands in OUT/compile_plans/, a start without
    one failed."""
    from replaylm.bench import startup

    seen = []

    def fake_start(args, cache, timeout):
        seen.append((args.model, args.shipped_tuning_table, args.load_format,
                     list(cache.iterdir())))
        if args.model != "llama3-8b":
            plan = {"kernels": [{"fn": "replaylm.kernels.argmax:_argmax_kernel",
                                 "fn_key": "k", "data": "{}"}]}
            write(cache / "replaylm" / "compile_plans" / f"{args.model}-plan.json", plan)
        return {"ready_s": 9.0}

    monkeypatch.setattr(startup, "start_in_child", fake_start)
    out = tmp_path / "out"
    code = tuning_table.main(["plans", "--models", "qwen3-0.6b,llama3-8b", "--out", str(out)])
    assert code == 1  # llama3-8b recorded nothing
    assert seen == [("qwen3-0.6b", True, "dummy", []), ("llama3-8b", True, "dummy", [])]
    rows = json.loads((out / "plans.json").read_text())["starts"]
    assert rows[0]["plans"] == [str(out / "compile_plans" / "qwen3-0.6b-plan.json")]
    assert "no compile plan" in rows[1]["error"] and rows[1]["plans"] == []
    text = capsys.readouterr().out
    assert "[plans] qwen3-0.6b: ready in 9.00 s, 1 kernels" in text
    assert f"ship-plans {out / 'compile_plans' / 'qwen3-0.6b-plan.json'}" in text


def test_ship_plans_copies_compile_plans_and_refuses_other_files(tmp_path):
    plan = write(tmp_path / "nvidia-h200-1.json",
                 {"kernels": [{"fn": "replaylm.kernels.argmax:_argmax_kernel", "fn_key": "k",
                               "data": "{}"}]})
    bad = write(tmp_path / "bad.json", {"kernels": [{"fn": "x"}]})
    shipped = tmp_path / "shipped"
    assert tuning_table.main(["ship-plans", str(plan), str(bad), "--plan-dir", str(shipped)]) == 2
    assert not shipped.exists()
    assert tuning_table.main(["ship-plans", str(plan), "--plan-dir", str(shipped)]) == 0
    assert (shipped / plan.name).read_text() == plan.read_text()
