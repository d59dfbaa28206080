"""The tier-agreement hook in one process: a stand-in ``agree`` plays the other ranks."""

from __future__ import annotations

import pytest
import torch

from replaylm import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [[1 + (5 * i + 3 * j) % 250 for j in range(2 + (7 * i) % 13)] for i in range(6)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tests.conftest import make_checkpoint

    path = tmp_path_factory.mktemp("agree-qwen3")
    make_checkpoint("qwen3", path, seed=9)
    return path


def _llm(path, mode: str = "ragged") -> LLM:
    return LLM(str(path), num_kv_blocks=30, max_num_seqs=6, max_num_batched_tokens=40,
               max_model_len=128, max_graph_tokens=32, skip_tokenizer_init=True,
               attention_backend="torch_dense", cuda_graph_mode=mode, graph_check=1,
               poison_padding=True)


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_agreed_larger_steps_pad_to_the_agreed_tier_with_the_same_tokens(ckpt):
    want = _tokens(_llm(ckpt))
    llm = _llm(ckpt)
    seen = []

    def agree(tokens, reqs, uniform, graph):  # another rank always runs 20 tokens
        seen.append(tokens)
        return max(tokens, 20), max(reqs, 3), False, graph

    llm.engine.agree = agree
    assert _tokens(llm) == want
    g = llm.graph_stats()
    assert g["agreement_steps"] == len(seen) > 0
    assert set(g["hits"]) <= {"ragged:24", "ragged:32"}
    # Padding the agreement added: up from this engine's own tier (a step with no work of
    # its own replays the whole agreed tier); steps of more than 20 tokens were its own.
    policy = llm.engine.runner.policy
    added = sum(24 - (policy.dispatch(t, 1, False).tier if t else 0) for t in seen if t <= 20)
    assert g["agreement_padded_tokens"] == added > 0
    assert sum(g["dummy_steps"].values()) == seen.count(0)


def _count_replays(runtime) -> list[str]:
    """Wrap every graph's replay to record its name in the returned list."""
    graphs = list(runtime.whole.graphs.values()) if runtime.whole else []
    if runtime.piecewise:
        graphs += [g for links in runtime.piecewise.links.values() for g in links]
    replays: list[str] = []
    for g in graphs:
        g.replay = (lambda g=g, real=g.replay: (replays.append(g.name), real())[1])
    return replays


@pytest.mark.parametrize("mode, agreed, key", [
    ("ragged", (7, 2, False, True), "ragged:8"),
    ("full", (3, 3, True, True), "full:4"),
    ("piecewise", (7, 2, False, True), "piecewise:8"),
])
def test_an_idle_rank_replays_the_agreed_graph_on_all_padding(ckpt, mode, agreed, key):
    llm = _llm(ckpt, mode)
    runner = llm.engine.runner
    runtime = runner.graphs
    replays = _count_replays(runtime)
    kv = [k.clone() for k, _ in runner.kv_caches]
    d = runner.idle(lambda *a: agreed)
    assert f"{d.mode}:{d.tier}" == key
    assert replays and all(name.startswith(key) for name in replays)
    assert runtime.stats.dummy_steps == {key: 1}
    assert runtime.stats.agreement_padded_tokens == d.tier
    assert runtime.stats.hits == {}
    # Padding writes only the scratch block 0: no request's KV changed.
    for before, (after, _) in zip(kv, runner.kv_caches):
        assert torch.equal(before[1:], after[1:])
    n = len(replays)
    # Nobody has work, or another rank must run eagerly: no replay here.
    assert not runner.idle(lambda *a: (0, 0, True, True)).graphed
    d = runner.idle(lambda *a: (4, 1, True, False))
    assert not d.graphed and "eagerly" in d.reason
    assert len(replays) == n and runtime.stats.agreement_steps == 3
