"""Data-parallel attention on CPU: two worker processes over gloo, against one engine.

Each rank runs attention on its own requests; the dense MLP is split across the two ranks
(all-gather of the agreed token count, the MLP slice, reduce-scatter). Greedy tokens must be
one process's, in every mode, whatever the load on each rank.
"""

from __future__ import annotations

import dataclasses
import multiprocessing

import pytest
import torch

from replaylm import LLM, SamplingParams
from replaylm.batch import HostBatch
from replaylm.config import EngineArgs
from replaylm.engine.loading import load_model_config
from replaylm.model.loader import load_model
from replaylm.model.parallel import (
    DataParallelAttention,
    check_dp_attention,
    dp_attention_config,
)

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [[1 + (7 * i + 3 * j) % 250 for j in range(2 + (5 * i) % 19)] for i in range(8)]
LONG = [3 + (11 * j) % 240 for j in range(60)]  # chunks of 40 and 20 tokens
LONE = [5 + (13 * j) % 230 for j in range(60)]  # the same, sharing no prefix with the others


def _checkpoint(tmp_path_factory, kind: str, **overrides):
    from tests.conftest import make_checkpoint

    path = tmp_path_factory.mktemp(f"dpa-{kind}")
    make_checkpoint(kind, path, seed=7, **overrides)
    return path


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    # Biased projections: the down_proj bias lives on rank 0 alone.
    return _checkpoint(tmp_path_factory, "llama", attention_bias=True, mlp_bias=True)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return _checkpoint(tmp_path_factory, "qwen3")


def _kw(mode: str) -> dict:
    kw = dict(num_kv_blocks=40, max_num_seqs=6, max_num_batched_tokens=40, max_model_len=128,
              max_graph_tokens=32, skip_tokenizer_init=True, distributed_timeout_s=120.0,
              attention_backend="torch" if mode == "piecewise" else "torch_dense")
    if mode == "eager":
        return kw | dict(enforce_eager=True)
    return kw | dict(cuda_graph_mode=mode, graph_check=1, poison_padding=True)


def _tokens(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _dp_attention(path, mode: str) -> LLM:
    return LLM(str(path), data_parallel_size=2, enable_dp_attention=True, **_kw(mode))


# Start-up errors and the shards, in one process ----------------------------------------------


def test_bad_combinations_are_refused_at_start_up(qwen3, tmp_path_factory):
    with pytest.raises(ValueError, match=r"enable_dp_attention=True needs data_parallel_size "
                                         r">= 2 \(got 1\)"):
        EngineArgs(enable_dp_attention=True)
    with pytest.raises(ValueError, match=r"enable_dp_attention=True needs tensor_parallel_size=1 "
                                         r"\(got 2\)"):
        EngineArgs(enable_dp_attention=True, data_parallel_size=2, tensor_parallel_size=2)
    EngineArgs(enable_dp_attention=True, data_parallel_size=2)
    cfg, _ = load_model_config(str(qwen3))  # intermediate_size 128
    check_dp_attention(cfg, 4)
    with pytest.raises(ValueError, match=r"enable_dp_attention=True with data_parallel_size=3: "
                                         r"3 ranks do not divide the model's intermediate_size 128"):
        check_dp_attention(cfg, 3)
    with pytest.raises(ValueError, match="enable_dp_attention=True .* not supported for MoE"):
        check_dp_attention(dataclasses.replace(cfg, num_experts=4), 2)
    # The driver refuses before it starts any process, naming the field.
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match="enable_dp_attention=True with data_parallel_size=3"):
        LLM(str(qwen3), data_parallel_size=3, enable_dp_attention=True, **_kw("eager"))
    moe = _checkpoint(tmp_path_factory, "qwen3_moe")
    with pytest.raises(ValueError, match="enable_dp_attention=True .* not supported for MoE"):
        LLM(str(moe), data_parallel_size=2, enable_dp_attention=True, **_kw("eager"))
    assert set(multiprocessing.active_children()) == before


def test_each_rank_holds_every_head_and_its_slice_of_the_mlp(llama):
    cfg, _ = load_model_config(str(llama))
    full = dict(load_model(cfg, llama, "auto", torch.float32, torch.device("cpu"), 0)
                .named_parameters())
    local = dp_attention_config(cfg, 2)
    assert (local.num_heads, local.num_kv_heads, local.vocab_size) == (
        cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size)
    assert local.intermediate_size == cfg.intermediate_size // 2
    shards = [dict(load_model(local, llama, "auto", torch.float32, torch.device("cpu"), 0,
                              full_cfg=cfg, dp=DataParallelAttention(r, 2)).named_parameters())
              for r in range(2)]
    inter = local.intermediate_size
    mlp = ("gate_up_proj", "down_proj")
    for name, whole in full.items():
        if not any(m in name for m in mlp):  # attention, norms, embedding, LM head: whole
            assert all(torch.equal(s[name], whole) for s in shards), name
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        for half in range(2):  # gate, then up: each rank holds its rows of both
            got = torch.cat([s[p + "gate_up_proj.weight"][half * inter:(half + 1) * inter]
                             for s in shards])
            want = full[p + "gate_up_proj.weight"][half * 2 * inter:(half + 1) * 2 * inter]
            assert torch.equal(got, want)
        assert torch.equal(torch.cat([s[p + "down_proj.weight"] for s in shards], 1),
                           full[p + "down_proj.weight"])
        assert torch.equal(shards[0][p + "down_proj.bias"], full[p + "down_proj.bias"])
        assert not shards[1][p + "down_proj.bias"].any()


def test_an_idle_rank_pads_to_the_agreed_size_with_one_empty_request():
    host = HostBatch.empty().padded(5, scratch_slot=6)
    assert (host.num_tokens, host.num_reqs, host.num_sampled, host.max_q_len) == (5, 1, 0, 0)
    assert host.cu_seqlens_q.tolist() == [0, 0] and host.kv_lens.tolist() == [0]
    assert host.req_slots.tolist() == [6] and not host.slot_mapping.any()


# Two processes --------------------------------------------------------------------------------


def _sampled(llm: LLM) -> list[tuple[list[int], list[float]]]:
    """Seeded sampling with prompt logprobs (an eager step on its rank, padded to the agreed
    size on both) beside greedy requests."""
    params = [SamplingParams(max_tokens=5, temperature=0.8, top_p=0.9, seed=i,
                             prompt_logprobs=2 if i % 2 else None, ignore_eos=True)
              for i in range(4)]
    outs = llm.generate(PROMPTS[2:6], params, use_tqdm=False)
    return [(o.outputs[0].token_ids,
             [lp.logprob for lp in (o.prompt_logprobs or []) if lp is not None]) for o in outs]


def _same(got, want) -> None:
    for (tokens, lps), (want_tokens, want_lps) in zip(got, want):
        assert tokens == want_tokens
        assert len(lps) == len(want_lps)
        assert max((abs(a - b) for a, b in zip(lps, want_lps)), default=0.0) < 1e-4


def test_eager_dp_attention_matches_one_process(llama):
    single = LLM(str(llama), **_kw("eager"))
    want, want_long, want_sampled = _tokens(single), _tokens(single, [LONG]), _sampled(single)
    with _dp_attention(llama, "eager") as llm:
        assert len(llm.engine.procs) == 2
        assert _tokens(llm) == want
        _same(_sampled(llm), want_sampled)
        before = llm.graph_stats()["ranks"]
        assert _tokens(llm, [LONG]) == want_long  # one rank busy, the other idle
        after = llm.graph_stats()["ranks"]
    idle = [a["dummy_steps"].get("eager", 0) - b["dummy_steps"].get("eager", 0)
            for a, b in zip(after, before)]
    # Every step of the lone request ran on both ranks: its two prefill chunks and the decodes.
    assert sorted(idle) == [0, 2 + GREEDY.max_tokens - 1]


def test_ragged_dp_attention_matches_one_process_under_uneven_load(qwen3):
    """Graph steps replay the agreed tier on both ranks; steps above the top tier (40-token
    chunks) and prompt-logprob steps run eagerly on both, padded to the larger. While one
    rank prefills and decodes a lone request, the other replays each of its graphs on padding
    and runs each of its eager steps padded (the same collectives)."""
    prompts = PROMPTS[:5] + [LONG]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    single = LLM(str(qwen3), **_kw("ragged"))
    want, want_lone = _tokens(single, prompts), _tokens(single, [LONE], params)
    want_sampled = _sampled(single)
    with _dp_attention(qwen3, "ragged") as llm:
        assert _tokens(llm, prompts) == want
        _same(_sampled(llm), want_sampled)
        before = llm.graph_stats()["ranks"]
        assert _tokens(llm, [LONE], params) == want_lone
        g = llm.graph_stats()
    after = g["ranks"]
    assert g["checks"] > 0 and g["agreement_seconds"] > 0

    def delta(rank: int, key: str) -> dict[str, int]:
        a, b = after[rank][key], before[rank][key]
        return {k: a[k] - b.get(k, 0) for k in a if a[k] != b.get(k, 0)}

    busy = 0 if delta(0, "hits") else 1
    idle = 1 - busy
    hits, eager = delta(busy, "hits"), sum(delta(busy, "fallbacks").values())
    assert sum(hits.values()) >= params.max_tokens - 1 and eager == 1  # the 40-token chunk
    assert delta(idle, "hits") == {} and delta(idle, "fallbacks") == {}
    assert delta(idle, "dummy_steps") == hits | {"eager": eager}
    assert delta(busy, "dummy_steps") == {}
    # The idle rank's padding: every tier it replayed and the eager chunk's 40 tokens.
    graph_tokens = sum(int(k.split(":")[1]) * n for k, n in hits.items())
    pad = after[idle]["agreement_padded_tokens"] - before[idle]["agreement_padded_tokens"]
    assert pad == graph_tokens + 40
    assert after[busy]["agreement_padded_tokens"] == before[busy]["agreement_padded_tokens"]
    # Both ranks count the same graph steps, so they graph-check the same ones (the eager
    # re-run's collectives meet).
    checks = [a["checks"] - b["checks"] for a, b in zip(after, before)]
    assert checks[0] == checks[1] == sum(hits.values())


def test_piecewise_dp_attention_matches_one_process(llama):
    """The MLP collectives inside the captured links; attention eager between them."""
    want = _tokens(LLM(str(llama), **_kw("piecewise")), PROMPTS + [LONG])
    with _dp_attention(llama, "piecewise") as llm:
        assert _tokens(llm, PROMPTS + [LONG]) == want
        g = llm.graph_stats()
    assert sum(k.startswith("piecewise:") for k in g["hits"]) > 0 and g["checks"] > 0


def test_speculative_dp_attention_matches_plain_one_process(qwen3):
    """n-gram drafts verified on both ranks through the agreement (ragged verify graphs and
    padded eager chunks): the tokens of one plain engine, drafts accepted."""
    spans = [[5 + (13 * i + 7 * j) % 200 for j in range(4 + i % 3)] for i in range(6)]
    prompts = [(s * 5)[: 4 + 3 * len(s)] for s in spans] + [LONG]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    want = _tokens(LLM(str(qwen3), **_kw("ragged")), prompts, params)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    with LLM(str(qwen3), data_parallel_size=2, enable_dp_attention=True,
             speculative_config=spec, **_kw("ragged")) as llm:
        assert _tokens(llm, prompts, params) == want
        st = llm.spec_stats()
    assert st["draft_tokens"] > 0 and st["accepted_tokens"] > 0 and st["verify_steps"] > 0
