"""Temperature rows drawn in the step's tail (``graphs.whole.step_tail``): a step whose rows
need nothing more takes the tail's samples with no sampling launch after the graph, and they
are the tokens the full sampler path draws."""

from __future__ import annotations

import pytest

from replaylm import LLM, SamplingParams
from replaylm.sampling import step as step_mod


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from tests.conftest import make_checkpoint

    path = tmp_path_factory.mktemp("tail-draws")
    make_checkpoint("llama", path, seed=5)
    return path


def _run(path, tail_draws: bool, params: list[SamplingParams]) -> list[list[int]]:
    llm = LLM(str(path), num_kv_blocks=16, max_num_seqs=4, max_model_len=96,
              max_graph_tokens=16, skip_tokenizer_init=True, attention_backend="torch_dense",
              cuda_graph_mode="ragged", graph_check=1, poison_padding=True)
    llm.engine.runner.sampler.tail_draws = tail_draws  # off: every such step samples again
    prompts = [[5 + i, 9, 13 + 2 * i, 7] for i in range(len(params))]
    outs = llm.generate(prompts, params)
    return [o.outputs[0].token_ids for o in outs]


def test_tail_draws_are_the_samplers_tokens(llama_dir, monkeypatch):
    """Seeded temperature requests mixed with greedy ones: the tokens with tail draws equal
    those of the sampler path, and no step calls the sampler after its graph; a request with
    top-k still goes through it."""
    params = [SamplingParams(temperature=t, seed=s, max_tokens=12, ignore_eos=True)
              for t, s in ((0.8, 1), (0.0, 2), (1.3, 3), (0.5, 4))]
    calls = []
    real = step_mod.sample
    monkeypatch.setattr(step_mod, "sample", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    want = _run(llama_dir, False, params)
    assert calls  # the sampler path did sample
    calls.clear()
    assert _run(llama_dir, True, params) == want
    assert not calls
    assert len({tuple(t) for t in want}) == len(want)  # the rows drew different tokens
    _run(llama_dir, True, params[:1] + [SamplingParams(temperature=0.9, top_k=3, seed=9,
                                                       max_tokens=4, ignore_eos=True)])
    assert calls
