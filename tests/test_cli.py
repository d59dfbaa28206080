"""The ``replaylm`` command line, run in-process on the tiny built-in model (CPU)."""

from __future__ import annotations

import json

import pytest

from replaylm.cli.main import main


@pytest.mark.parametrize(
    "argv", [[], ["generate"], ["demo"], ["serve"], ["bench"], ["bench", "decode"]],
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
        "--repeats", "1", "--json", str(out),
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
