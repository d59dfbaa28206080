"""``replaylm bench serve`` end to end on the built-in default model (CPU): in this process,
and against a real ``replaylm serve`` process on loopback."""

from __future__ import annotations

import importlib.util
import json

import pytest

from replaylm.cli.main import main
from tests.bench.png import assert_png

TINY = ["--num-requests", "5", "--input-len", "8", "--output-len", "5", "--len-dist",
        "uniform", "--no-progress"]


def _check_runs(record: dict, modes: list[str], labels: list[str], n: int) -> None:
    runs = record["runs"]
    assert [(r["mode"], r["rate_label"]) for r in runs] == [(m, lab) for m in modes
                                                            for lab in labels]
    for r in runs:
        assert r["completed"] == n and r["failed"] == 0, r["errors"]
        assert len(r["requests"]) == n
        assert all(q["output_tokens"] == q["output_len"] for q in r["requests"])
        assert r["output_tokens"] == sum(q["output_len"] for q in r["requests"])
        for key in ("ttft_ms", "e2e_ms", "itl_ms", "tpot_ms"):
            d = r[key]
            assert 0 < d["p50"] <= d["p90"] <= d["p99"], (key, d)
        assert r["ttft_ms"]["p99"] <= r["e2e_ms"]["p99"]
        assert r["request_throughput"] > 0 and r["output_throughput"] > 0
        assert 0 <= r["goodput"]["requests"] <= n


def test_in_process_modes_and_rates(tmp_path):
    out = tmp_path / "serve.json"
    rc = main(["bench", "serve", "--device", "cpu", *TINY, "--modes", "eager,ragged",
               "--graph-tiers", "1,8", "--request-rates", "20,inf", "--slo-ttft-ms", "60000",
               "--json", str(out)])
    assert rc == 0
    record = json.loads(out.read_text())
    assert record["target"] == "in-process"
    _check_runs(record, ["eager", "ragged"], ["20", "inf"], 5)
    assert set(record["engines"]) == {"eager", "ragged"}
    assert record["engines"]["ragged"]["num_graphs"] == 4  # two tiers, each with its tail
    ragged = [r for r in record["runs"] if r["mode"] == "ragged"]
    assert all(r["padding_share"] > 0 for r in ragged)  # 5 requests run in the tier of 8
    assert all(r["goodput"]["requests"] == 5 for r in record["runs"])  # a 60 s TTFT bound
    # The same lengths in every run, different prompts (no run reuses another's prefix).
    lengths = [[(q["prompt_len"], q["output_len"]) for q in r["requests"]] for r in record["runs"]]
    assert all(x == lengths[0] for x in lengths)
    assert_png(tmp_path / "serve_latency.png")
    assert_png(tmp_path / "serve_throughput.png")


def test_trace_file_in_process(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps(d) for d in [
        {"arrival_s": 0.0, "prompt": "def f(x):", "output_len": 3},
        {"arrival_s": 0.2, "prompt_len": 7, "output_len": 4},
        {"arrival_s": 0.3, "prompt": [11, 12, 13], "output_len": 2},
    ]))
    out = tmp_path / "trace.json"
    # The built-in model has a tokenizer, so bench serve loads it (as a server would) and the
    # text prompt runs.
    assert main(["bench", "serve", "--device", "cpu", "--trace", str(trace), "--no-progress",
                 "--json", str(out)]) == 0
    run = json.loads(out.read_text())["runs"][0]
    assert run["rate_label"] == "trace" and run["completed"] == 3
    assert [q["output_tokens"] for q in run["requests"]] == [3, 4, 2]
    assert [q["prompt_len"] for q in run["requests"]][1:] == [7, 3]
    assert run["requests"][1]["sent_s"] >= 0.2


def test_rejects_conflicting_flags(capsys):
    assert main(["bench", "serve", "--request-rate", "1", "--request-rates", "1,2"]) == 2
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--modes", "eager"]) == 2
    assert "error:" in capsys.readouterr().err


def test_unreachable_server_is_a_clear_error(capsys):
    from tests.serve_process import free_port

    url = f"http://127.0.0.1:{free_port()}"
    assert main(["bench", "serve", "--base-url", url, "--num-requests", "1"]) == 1
    assert f"no OpenAI-compatible server at {url}" in capsys.readouterr().err


@pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in
                        ("fastapi", "uvicorn", "prometheus_client", "httpx")),
                    reason="needs the server and bench extras")
def test_against_a_real_server_process(tmp_path):
    from tests.serve_process import serve_process

    with serve_process(tmp_path / "serve.log", "--log-level", "warning") as (proc, url):
        out = tmp_path / "http.json"
        assert main(["bench", "serve", "--base-url", url + "/v1", *TINY, "--request-rates",
                     "10,inf", "--slo-ttft-ms", "60000", "--json", str(out)]) == 0
        assert proc.poll() is None
    record = json.loads(out.read_text())
    assert record["target"] == url
    _check_runs(record, ["default"], ["10", "inf"], 5)
    assert all(q["prompt_len"] and q["prompt_len"] >= 4
               for r in record["runs"] for q in r["requests"])
    assert_png(tmp_path / "http_latency.png")
