"""``replaylm bench spec`` on the built-in default model (CPU, tiny settings): every part
writes sane rows, and the controlled drafter's acceptance is what its ``p`` implies."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from replaylm.bench.spec_drafters import ControlledDrafter
from replaylm.bench.spec_plan import Options, config_of, engine_plan
from replaylm.cli.main import main
from tests.bench.png import assert_png

TINY = ["--model", "default", "--device", "cpu", "--num-kv-blocks", "48", "--max-model-len",
        "128", "--max-num-seqs", "4", "--prompt-len", "8", "--bench-seed", "3"]


def test_spec_bench_writes_every_part(tmp_path, capsys):
    out = tmp_path / "spec.json"
    rc = main(["bench", "spec", *TINY, "--verify-batch-sizes", "2", "--verify-k", "4",
               "--verify-steps", "2", "--verify-warmup", "1", "--batch-sizes", "2",
               "--ks", "4", "--acceptance", "0,0.95", "--new-tokens", "24",
               "--warmup-tokens", "1", "--draft-k", "2", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "(a) verify step" in text and "(b) controlled drafter" in text
    rows = json.loads(out.read_text())["rows"]

    ver = {(r["layout"], r["distribution"]): r for r in rows if r["part"] == "verify"}
    assert set(ver) == {(la, d) for la in ("ragged", "padded", "eager")
                        for d in ("uniform", "skewed")}
    for (layout, _), r in ver.items():
        assert r["steps"] == 2 and r["step_ms_median"] > 0 and r["verify_steps"] >= 1
        # Eager engine (CPU): only the padded layout runs tokens it does not need.
        if layout == "padded":
            assert r["run_tokens_per_step"] == 2 * 5  # two requests × (K + 1)
            assert r["padded_waste"] > 0 and r["layout_pad_tokens"] > 0
        else:
            assert r["padded_waste"] == 0 and r["run_tokens_per_step"] == r["real_tokens_per_step"]

    acc = {(r["config"], r["p"]): r for r in rows if r["part"] == "acceptance"}
    assert set(acc) == {("plain", None), ("fixed-k4", 0.0), ("fixed-k4", 0.95),
                        ("adaptive-k4", 0.0), ("adaptive-k4", 0.95)}
    for r in acc.values():
        assert r["generated_tokens"] == 2 * 24 and r["tok_s"] > 0
        if r["p"] is not None:
            # Speculation never changes greedy output, whatever the drafts.
            assert r["matches_reference"] == 2 and r["diverged_requests"] == 0
            assert r["speedup"] > 0
    zero, high = acc[("fixed-k4", 0.0)], acc[("fixed-k4", 0.95)]
    assert zero["verify_steps"] > 0 and zero["accepted_tokens"] == 0
    assert zero["mean_accepted_length"] == 0 and zero["expected_accepted_length"] == 0
    # p = 0.95, K = 4: 0.95 + 0.95² + 0.95³ + 0.95⁴ = 3.52, less for the short drafts near
    # max_tokens (24 tokens: a few proposals per request, the last ones short).
    assert 2.5 < high["expected_accepted_length"] <= 3.52
    assert high["mean_accepted_length"] == pytest.approx(high["expected_accepted_length"],
                                                         rel=0.2)
    assert high["per_token_acceptance"] >= 0.8
    assert high["budget_tokens_per_step"] == 4
    assert acc[("adaptive-k4", 0.95)]["budget"] == "adaptive"
    assert acc[("adaptive-k4", 0.95)]["expected_accepted_length"] is None

    ngram = {r["config"]: r for r in rows if r["part"] == "ngram"}
    assert set(ngram) == {"plain", "fixed-k4", "adaptive-k4"}
    for name in ("fixed-k4", "adaptive-k4"):
        assert 0 <= ngram[name]["acceptance_rate"] <= 1 and ngram[name]["speedup"] > 0
        assert ngram[name]["generated_tokens"] == 2 * 24

    draft = {r["config"]: r for r in rows if r["part"] == "draft"}
    assert set(draft) == {"draft-model", "self-draft"}
    assert draft["draft-model"]["model"] == "llama3.2-1b"
    assert draft["self-draft"]["model"] == "default"
    # The default draft model does not share the built-in model's vocabulary: the row
    # carries the start-up error and the run goes on.
    assert "vocabulary" in draft["draft-model"]["error"]
    self_draft = draft["self-draft"]
    assert self_draft["error"] is None and self_draft["tok_s"] > 0 and self_draft["speedup"] > 0
    assert self_draft["acceptance_rate"] > 0.9  # the target drafting for itself (fp32, greedy)

    for suffix in ("verify", "acceptance", "drafters"):
        assert_png(tmp_path / f"spec_{suffix}.png")


def test_controlled_drafter_hits_its_rate_and_imposes_acceptance():
    class Req:
        def __init__(self, prompt, out):
            self.prompt_token_ids, self.output_token_ids = prompt, out

    ref = list(range(10, 60))
    d = ControlledDrafter({(1, 2): ref}, 0.7, vocab_size=100, seed=0)
    right = total = 0
    for g in range(0, 40):
        (draft,) = d.propose([Req([1, 2], ref[:g])], [4])
        assert len(draft) == 4
        right += sum(a == b for a, b in zip(draft, ref[g:g + 4]))
        total += 4
    assert abs(right / total - 0.7) < 0.1
    assert d.propose([Req([9], [])], [4]) == [[]]  # no reference: no drafts

    # Two requests of a verify: A (3 drafts, kept), B (no drafts), C (2 drafts, kept 1).
    a, b, c = Req([1, 2], ref[:5]), Req([1, 2], ref[:5]), Req([1, 2], ref[:5] + [0])
    (da,), (dc,) = d.propose([a], [3]), d.propose([c], [2])
    assert d.diverged == {(1, 2)} and len(dc) == 2  # C left its reference: random drafts
    d.right[id(a)] = [True, False, True]
    d.right[id(c)] = [True, True]
    sched = [SimpleNamespace(sample=True, drafts=da, request=a),
             SimpleNamespace(sample=True, drafts=[], request=b),
             SimpleNamespace(sample=False, drafts=[], request=None),  # a prefill chunk
             SimpleNamespace(sample=True, drafts=dc[:1], request=c)]
    accept = d.acceptance(SimpleNamespace(scheduled=sched), None)
    # Sampled rows: A's 4, B's 1, C's 2; every sample equals its row's draft (as greedy
    # acceptance would accept them all), so only the imposition decides.
    tokens = torch.tensor(da + [7] + [5] + dc[:1] + [8])
    got = accept(None, tokens).tolist()
    assert got[0] == da[0] and got[1] != da[1] and got[2] == da[2]  # right, wrong, right
    assert got[3:5] == [7, 5] and got[5] == dc[0] and got[6] == 8
    assert d.acceptance(SimpleNamespace(scheduled=sched[1:3]), None) is None


def test_plan_builds_each_engine_once_plain_first():
    plan = engine_plan(Options(ks=(2, 8), verify_k=8), "default")
    labels = [label for label, _, _ in plan]
    assert labels[0] == "plain" and len(labels) == len(set(labels))
    roles = {label: r for label, _, r in plan}
    assert roles["fixed-k8"] == {"layout", "controlled", "ngram"}
    assert roles["adaptive-k8"] == {"controlled", "ngram"}
    assert {"verify-padded-k8", "verify-eager-k8", "draft-model", "self-draft"} <= set(labels)


def test_plan_runs_fixed_k_with_each_pipeline_setting():
    plan = {label: (spec, roles) for label, spec, roles in
            engine_plan(Options(parts=("acceptance",), ks=(4,), pipelines=("on", "off")),
                        "default")}
    assert set(plan) == {"plain", "fixed-k4-pipeline-on", "fixed-k4-pipeline-off",
                         "adaptive-k4"}
    assert plan["fixed-k4-pipeline-on"][0]["pipeline"] == "on"
    assert plan["fixed-k4-pipeline-off"][0]["pipeline"] == "off"
    assert config_of("fixed-k4-pipeline-off", plan["fixed-k4-pipeline-off"][0])[
        "pipeline"] == "off"
