"""The verify layouts (``speculative_config['verify']``): ragged, padded and eager emit the
tokens plain decoding emits; padded counts its padding rows as waste."""

from __future__ import annotations

import pytest

from replaylm import SamplingParams
from replaylm.config import EngineArgs
from tests.speculative.test_spec_engine import NGRAM, _engine, _traffic


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    from tests.conftest import make_checkpoint

    path = tmp_path_factory.mktemp("spec-layout-qwen3")
    make_checkpoint("qwen3", path, seed=11)
    return path

@pytest.fixture(scope="module")
def plain_traffic(qwen3_dir):
    return _traffic(_engine(qwen3_dir, "eager"))


# ``ragged`` (the default layout) is covered in every graph mode by test_spec_engine.
@pytest.mark.parametrize("mode, verify", [("eager", "padded"), ("ragged", "padded"),
                                          ("piecewise", "padded"), ("ragged", "eager")])
def test_every_layout_matches_plain(qwen3_dir, plain_traffic, mode, verify):
    llm = _engine(qwen3_dir, mode, NGRAM | {"verify": verify})
    assert _traffic(llm) == plain_traffic
    st = llm.spec_stats()
    assert st["verify"] == verify and st["verify_steps"] > 0 and st["accepted_tokens"] > 0
    if verify == "padded":
        assert st["layout_pad_tokens"] > 0
        assert st["padded_waste"] > 0
    else:
        assert st["layout_pad_tokens"] == 0
    gs = llm.graph_stats()
    if mode != "eager":
        assert gs["checks"] > 0 and sum(gs["hits"].values()) > 0
        assert gs["real_tokens"] < gs["padded_tokens"] or verify != "padded"
    if mode != "eager" and verify == "eager":
        assert gs["fallbacks"]["speculative_config verify=eager"] >= st["verify_steps"]
    else:
        assert "speculative_config verify=eager" not in gs["fallbacks"]


def _batch_run(llm, prompts, sp):
    outs = llm.generate(prompts, sp, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_padded_layout_pads_every_decoding_request_to_k_plus_1(qwen3_dir):
    # Decoding requests alone (equal prompts prefill together): every verify step holds
    # (k + 1) tokens per running request.
    prompts = [[40 + i, 41, 42] * 5 for i in range(4)]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = _batch_run(_engine(qwen3_dir, "eager", num_kv_blocks=40), prompts, sp)
    ragged = _engine(qwen3_dir, "eager", NGRAM, num_kv_blocks=40)
    padded = _engine(qwen3_dir, "eager", NGRAM | {"verify": "padded"}, num_kv_blocks=40)
    assert _batch_run(ragged, prompts, sp) == want
    assert _batch_run(padded, prompts, sp) == want
    r, p = ragged.spec_stats(), padded.spec_stats()
    k1 = NGRAM["num_speculative_tokens"] + 1
    # Eager steps run as laid out, so all of their waste is the layout's padding.
    assert p["verify_step_padded_tokens"] % k1 == 0
    assert p["verify_step_padded_tokens"] >= p["verify_steps"] * k1
    assert p["layout_pad_tokens"] == p["verify_step_padded_tokens"] - p["verify_step_tokens"]
    assert r["padded_waste"] == 0 < p["padded_waste"]


def test_padded_layout_with_prompt_logprobs_in_the_same_step(qwen3_dir):
    # A prompt with prompt_logprobs prefills while another request verifies padded drafts:
    # the prompt rows must be found past the padding.
    def run(llm):
        core = llm.engine
        core.add_request("a", [60, 61, 62] * 6,
                         SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
        got: dict[str, list] = {"a": [], "b": []}
        for _ in range(4):
            for d in core.step():
                got[d.request_id].extend(d.new_token_ids)
        core.add_request("b", [70, 71, 72, 73, 74, 75, 76],
                         SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=2,
                                        ignore_eos=True))
        lps = None
        while core.has_unfinished():
            for d in core.step():
                got[d.request_id].extend(d.new_token_ids)
                if d.prompt_logprobs is not None:
                    lps = d.prompt_logprobs
        return got, lps

    want, want_lps = run(_engine(qwen3_dir, "eager", num_kv_blocks=40))
    llm = _engine(qwen3_dir, "eager", NGRAM | {"verify": "padded"}, num_kv_blocks=40)
    got, got_lps = run(llm)
    assert got == want
    assert llm.spec_stats()["layout_pad_tokens"] > 0
    assert len(got_lps) == len(want_lps)
    for a, b in zip(got_lps, want_lps):
        if b is None:
            assert a is None
            continue
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)


def test_bad_verify_layout_names_the_field():
    with pytest.raises(ValueError, match=r"speculative_config\['verify'\]='uniform' is invalid"):
        EngineArgs(speculative_config=NGRAM | {"verify": "uniform"})
