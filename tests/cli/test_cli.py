"""The ``replaylm`` command line, run in-process on the tiny built-in model (CPU)."""

from __future__ import annotations

import json

import pytest

from replaylm.cli.main import main


@pytest.mark.parametrize(
    "argv", [[], ["generate"], ["demo"], ["serve"], ["bench"], ["bench", "decode"],
             ["bench", "serve"], ["bench", "startup"]],
    ids=" ".join
)
def test_help_exits_zero(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--help"])
    assert exc.value.code == 0
    assert "usage: replaylm" in capsys.readouterr().out


def test_no_command_prints_help_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "usage: replaylm" in capsys.readouterr().err


def test_generate_json_default_model(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main([
        "generate", "--model", "default", "--device", "cpu", "--prompt", "Hello, world",
        "--max-tokens", "5", "--ignore-eos", "--temperature", "0", "--json",
    ])
    assert rc == 0
    record = json.loads(capsys.readouterr().out)
    assert len(record["token_ids"]) == 5
    assert record["finish_reason"] == "length"
    assert isinstance(record["text"], str)
    assert record["prompt_token_ids"]
    assert record["timing"]["generate_s"] > 0


def test_bench_decode_writes_rows(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "decode.json"
    rc = main([
        "bench", "decode", "--model", "default", "--device", "cpu", "--batch-sizes", "1,4",
        "--new-tokens", "8", "--prompt-len", "8", "--batched-prompt-len", "8",
        "--repeats", "1", "--batched-requests", "4", "--batched-repeats", "1",
        "--json", str(out),
    ])
    assert rc == 0
    assert "floor" in capsys.readouterr().out
    record = json.loads(out.read_text())
    assert record["torch"] and record["device"] and record["command"].startswith("replaylm bench")
    rows = record["rows"]
    assert [r["batch"] for r in rows] == [1, 4]
    for r in rows:
        assert r["tok_s"] > 0
        assert r["generated_tokens"] == 8 * r["batch"]
    assert rows[0]["floor_ms"] > 0 and rows[0]["floor_share"] > 0


def test_bench_decode_rejects_unknown_mode(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "decode", "--model", "default", "--modes", "turbo"]) == 2
    assert "unknown mode" in capsys.readouterr().err


def test_resolve_model_unknown_name_lists_shapes() -> None:
    from replaylm.model.shapes import resolve_model

    with pytest.raises(FileNotFoundError, match="llama3.2-1b"):
        resolve_model("no-such-model-anywhere")


def test_bench_decode_profile_writes_steps_and_trace(tmp_path, capsys) -> None:
    """--profile: per-step samples (CPU time, graph nodes) and a Chrome trace per row."""
    prof = tmp_path / "prof"
    rc = main([
        "bench", "decode", "--model", "default", "--device", "cpu", "--batch-sizes", "1",
        "--new-tokens", "6", "--prompt-len", "8", "--repeats", "1", "--modes", "ragged",
        "--graph-tiers", "1,8", "--profile", str(prof),
    ])
    assert rc == 0
    out = capsys.readouterr().out
    assert "[profile] mode=ragged batch=1" in out and "graph nodes" in out
    steps = json.loads((prof / "ragged_b1.steps.json").read_text())
    assert len(steps["steps"]) == 6  # one per launched step: the prefill and 5 decodes
    decode = steps["steps"][1:]
    assert all(s["mode"] == "ragged" and s["tier"] == 1 and s["cpu_ms"] > 0 for s in decode)
    # The CPU stand-in counts the kernels its capture dispatched: the graph's nodes.
    assert all(s["graph_nodes"] and s["graph_nodes"] > 10 for s in decode)
    assert steps["summary"]["graph_nodes"] == decode[0]["graph_nodes"]
    trace = json.loads((prof / "ragged_b1.trace.json").read_text())
    assert trace["traceEvents"]
