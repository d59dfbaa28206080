"""Tensor parallelism on CPU: two worker processes over gloo, against one engine."""

from __future__ import annotations

import dataclasses
import json
import math
import multiprocessing
import os
import signal
import threading
import time

import pytest
import torch

from replaylm import LLM, SamplingParams
from replaylm.config import EngineArgs
from replaylm.distributed.driver import WorkerError
from replaylm.engine.loading import load_model_config
from replaylm.model.loader import (
    build_empty,
    checkpoint_files,
    iter_checkpoint_slices,
    load_model,
    load_weights,
)
from replaylm.model.parallel import TensorParallel, check_tensor_parallel, shard_config

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [[1 + (7 * i + 3 * j) % 250 for j in range(2 + (5 * i) % 19)] for i in range(8)]


def _checkpoint(tmp_path_factory, kind: str, **overrides):
    from tests.conftest import make_checkpoint

    path = tmp_path_factory.mktemp(f"tp-{kind}")
    make_checkpoint(kind, path, seed=3, **overrides)
    return path


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    # A biased o_proj and MLP: row-parallel biases live on rank 0 alone.
    return _checkpoint(tmp_path_factory, "llama", attention_bias=True, mlp_bias=True)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    # One KV head: both ranks hold it (replicated), each with its 2 query heads.
    return _checkpoint(tmp_path_factory, "qwen3", num_key_value_heads=1)


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory) -> dict:
    """Qwen2-MoE: experts of 32 (16 a rank), a shared expert of 80 (40), a dense layer;
    Qwen3-MoE: experts of 48 (24 a rank, not a multiple of 16), no shared expert."""
    return {kind: _checkpoint(tmp_path_factory, kind) for kind in ("qwen2_moe", "qwen3_moe")}


@pytest.fixture(scope="module")
def moe_tp1_tokens(moe_checkpoints) -> dict:
    """TP=1's greedy tokens on each (eager: the graph tests check that graphs follow eager)."""
    return {kind: _tokens(LLM(str(path), **_kw("eager")))
            for kind, path in moe_checkpoints.items()}


@pytest.fixture(params=["qwen2_moe", "qwen3_moe"])
def moe(request, moe_checkpoints):
    return request.param, moe_checkpoints[request.param]


def _kw(mode: str) -> dict:
    kw = dict(num_kv_blocks=40, max_num_seqs=6, max_num_batched_tokens=40, max_model_len=128,
              max_graph_tokens=16, skip_tokenizer_init=True, attention_backend="torch_dense",
              distributed_timeout_s=120.0)
    if mode == "eager":
        return kw | dict(enforce_eager=True)
    return kw | dict(cuda_graph_mode=mode, graph_check=1, poison_padding=True)


def _tokens(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


# Start-up errors ----------------------------------------------------------------------------


def test_settings_and_shapes_are_validated(qwen3):
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineArgs(tensor_parallel_size=0)
    cfg, _ = load_model_config(str(qwen3))  # 4 heads, 1 KV head, intermediate 128
    check_tensor_parallel(cfg, 4)  # the KV head replicated on every rank
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide the model's 4 "
                                         "attention heads"):
        check_tensor_parallel(cfg, 3)
    with pytest.raises(ValueError, match="tensor_parallel_size=4 is not a multiple of the "
                                         "model's 3 KV heads"):
        check_tensor_parallel(dataclasses.replace(cfg, num_heads=12, num_kv_heads=3), 4)
    with pytest.raises(ValueError, match="tensor_parallel_size=4 does not divide the model's 6 "
                                         "KV heads"):
        check_tensor_parallel(dataclasses.replace(cfg, num_heads=12, num_kv_heads=6), 4)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 does not divide the model's "
                                         "intermediate_size 97"):
        check_tensor_parallel(dataclasses.replace(cfg, intermediate_size=97), 2)
    # The driver refuses before it starts any process.
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match="tensor_parallel_size=3"):
        LLM(str(qwen3), tensor_parallel_size=3, **_kw("eager"))
    assert set(multiprocessing.active_children()) == before


# Sharded loading ----------------------------------------------------------------------------


class _SpySlice:
    """A safetensors slice that records which index each read asked for."""

    def __init__(self, name: str, inner, reads: dict) -> None:
        self.name, self.inner, self.reads = name, inner, reads

    def get_shape(self):
        return self.inner.get_shape()

    def __getitem__(self, index):
        self.reads.setdefault(self.name, []).append(index)
        return self.inner[index]


def test_each_rank_reads_only_its_slices_and_the_shards_make_the_model(llama):
    cfg, _ = load_model_config(str(llama))
    files = checkpoint_files(llama)
    full = dict(load_model(cfg, llama, "auto", torch.float32, torch.device("cpu"), 0)
                .named_parameters())
    shards = []
    for rank in range(2):
        tp = TensorParallel(rank, 2, None, cfg.num_kv_heads)
        reads: dict = {}
        model = build_empty(shard_config(cfg, 2), torch.float32, torch.device("cpu"), tp)
        load_weights(model, ((n, _SpySlice(n, s, reads))
                             for n, s in iter_checkpoint_slices(files)), cfg)
        shards.append(dict(model.named_parameters()))
        sliced = ("q_proj", "k_proj", "v_proj", "o_proj.weight", "gate_proj", "up_proj",
                  "down_proj.weight", "embed_tokens", "lm_head")
        for name, indices in reads.items():
            assert len(indices) == 1, name  # read once
            shape = next(s for n, s in iter_checkpoint_slices(files) if n == name).get_shape()
            read = [len(range(*i.indices(d))) for i, d in zip(indices[0], shape)]
            if any(k in name for k in sliced):
                assert 2 * math.prod(read) == math.prod(shape), (name, read, shape)  # half
            else:
                assert read == list(shape), name  # norms, row-parallel biases: whole
        assert any("o_proj.bias" in n for n in reads) == (rank == 0)  # rank 0 alone needs it

    def joined(name: str, dim: int) -> torch.Tensor:
        return torch.cat([s[name] for s in shards], dim)

    q, kv = cfg.q_size // 2, cfg.kv_size // 2
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        for suffix in ("weight", "bias"):
            w = [s[p + "qkv_proj." + suffix] for s in shards]
            assert torch.equal(torch.cat([x[:q] for x in w]), full[p + "qkv_proj." + suffix][: 2 * q])
            assert torch.equal(torch.cat([x[q:q + kv] for x in w]),
                               full[p + "qkv_proj." + suffix][2 * q: 2 * q + 2 * kv])
        assert torch.equal(joined(p + "o_proj.weight", 1), full[p + "o_proj.weight"])
        assert torch.equal(shards[0][p + "o_proj.bias"], full[p + "o_proj.bias"])
        assert not shards[1][p + "o_proj.bias"].any()
        inter = cfg.intermediate_size // 2
        gate = torch.cat([s[p + "gate_up_proj.weight"][:inter] for s in shards])
        assert torch.equal(gate, full[p + "gate_up_proj.weight"][: 2 * inter])
        assert torch.equal(joined(p + "down_proj.weight", 1), full[p + "down_proj.weight"])
    assert torch.equal(joined("embed_tokens.weight", 0), full["embed_tokens.weight"])
    assert torch.equal(joined("lm_head.weight", 0), full["lm_head.weight"])


def test_the_vocabulary_pads_to_a_multiple_of_the_ranks_and_kv_heads_replicate(
        tmp_path_factory):
    # vocab 255 over 2 ranks: 128 rows each, the last one zero; 1 KV head on both ranks.
    path = _checkpoint(tmp_path_factory, "qwen2", vocab_size=255)
    cfg, _ = load_model_config(str(path))
    full = dict(load_model(cfg, path, "auto", torch.float32, torch.device("cpu"), 0)
                .named_parameters())
    local = shard_config(cfg, 2)
    assert (local.num_heads, local.num_kv_heads) == (2, 1)
    for rank in range(2):
        tp = TensorParallel(rank, 2, None, cfg.num_kv_heads)
        model = load_model(local, path, "auto", torch.float32, torch.device("cpu"), 0, tp, cfg)
        emb = model.embed_tokens.weight
        assert emb.shape[0] == 128
        assert torch.equal(emb[: 128 - rank], full["embed_tokens.weight"][128 * rank: 128 * rank + 128 - rank])
        assert rank == 0 or not emb[127].any()
        qkv = model.layers[0].qkv_proj
        whole = full["layers.0.qkv_proj.bias"]
        assert torch.equal(qkv.bias[local.q_size:], whole[cfg.q_size:])  # the one KV head


# Two processes --------------------------------------------------------------------------------


def _sampled(llm: LLM) -> list[tuple[list[int], list[float]]]:
    """Seeded random sampling with penalties, and prompt logprobs: every rank samples the same
    tokens from the same logits and per-slot state."""
    params = [SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=i,
                             presence_penalty=0.5, prompt_logprobs=2, ignore_eos=True)
              for i in range(3)]
    outs = llm.generate(PROMPTS[3:6], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp.logprob for lp in o.prompt_logprobs if lp is not None])
            for o in outs]


def test_eager_tp2_matches_tp1_and_a_killed_worker_is_named_within_the_timeout(llama):
    single = LLM(str(llama), **_kw("eager"))
    want, want_sampled = _tokens(single), _sampled(single)
    with LLM(str(llama), tensor_parallel_size=2, **_kw("eager")) as llm:
        procs = list(llm.engine.procs)
        assert len(procs) == 2
        assert _tokens(llm) == want
        assert llm.stats().requests_finished == len(PROMPTS)
        for (tokens, lps), (want_tokens, want_lps) in zip(_sampled(llm), want_sampled):
            assert tokens == want_tokens
            assert len(lps) == len(want_lps) > 0
            assert max(abs(a - b) for a, b in zip(lps, want_lps)) < 1e-4
        # The follower killed between steps: named (not its leader, whose pipe breaks).
        os.kill(procs[1].pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerError, match=r"rank 1 \(data-parallel rank 0, "
                                                    r"tensor-parallel rank 1\) exited"):
            _tokens(llm)
        assert time.monotonic() - start < 10.0  # at once, not at the timeout
        assert not any(p.is_alive() for p in procs)
    assert not set(procs) & set(multiprocessing.active_children())


def test_ragged_tp2_matches_tp1_through_the_graph_stand_in(qwen3):
    long_prompt = [3 + (11 * j) % 240 for j in range(40)]  # above the top tier: eager steps
    prompts = PROMPTS[:5] + [long_prompt]
    want = _tokens(LLM(str(qwen3), **_kw("ragged")), prompts)
    with LLM(str(qwen3), tensor_parallel_size=2, **_kw("ragged")) as llm:
        assert _tokens(llm, prompts) == want
        g = llm.graph_stats()
        assert sum(g["hits"].values()) >= 5 and g["checks"] >= 5
        assert g["fallbacks"]  # the long prompt's chunks ran eagerly
        # all_reduce_backend auto on CPU: gloo, and why (each rank decided the same).
        assert g["all_reduce"]["summary"] == "gloo for every size"
        assert "symmetric memory needs CUDA tensors" in g["all_reduce"]["reason"]


def test_tp2_by_dp2_matches_tp1_and_an_idle_group_replays_the_agreed_tier(llama):
    """Four ranks: two data-parallel ranks, each a tensor-parallel group of two. While one
    group prefills and decodes a lone request, both ranks of the other replay the agreed
    graph on padding (their all-reduces meet inside it)."""
    lone = [[5 + (3 * j) % 200 for j in range(12)]]
    kw = _kw("ragged") | dict(graph_tiers="4,16")  # two captures per rank
    single = LLM(str(llama), **kw)
    want, want_lone = _tokens(single, PROMPTS[:4]), _tokens(single, lone)
    with LLM(str(llama), tensor_parallel_size=2, data_parallel_size=2, **kw) as llm:
        assert len(llm.engine.procs) == 4
        assert _tokens(llm, PROMPTS[:4]) == want
        before = [r["dummy_steps"] for r in llm.graph_stats()["ranks"]]
        assert _tokens(llm, lone) == want_lone
        after = [r["dummy_steps"] for r in llm.graph_stats()["ranks"]]
    idle = [sum(a.values()) - sum(b.values()) for a, b in zip(after, before)]
    assert sorted(idle)[0] == 0 and sorted(idle)[1] >= GREEDY.max_tokens - 1


def test_one_rank_calls_no_collective(qwen3, monkeypatch):
    """tensor_parallel_size=1 runs the single-GPU path: no torch.distributed call at all."""
    import torch.distributed as dist

    def forbidden(*args, **kwargs):
        raise AssertionError("a collective at tensor_parallel_size=1")

    for name in ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
                 "broadcast", "reduce_scatter_tensor"):
        if hasattr(dist, name):
            monkeypatch.setattr(dist, name, forbidden)
    llm = LLM(str(qwen3), **_kw("ragged"))
    assert llm.engine.runner.model.tp is None and llm.engine.runner.broadcast is None
    assert len(_tokens(llm, PROMPTS[:3])) == 3
    assert sum(llm.graph_stats()["hits"].values()) > 0


# Mixture of experts ---------------------------------------------------------------------------


def test_moe_expert_widths_must_divide(moe, tmp_path):
    kind, path = moe
    cfg, _ = load_model_config(str(path))
    local = shard_config(cfg, 2)
    assert local.moe_intermediate_size == cfg.moe_intermediate_size // 2
    assert local.shared_expert_intermediate_size == cfg.shared_expert_intermediate_size // 2
    with pytest.raises(ValueError, match="tensor_parallel_size=2 does not divide the model's "
                                         "moe_intermediate_size 33"):
        check_tensor_parallel(dataclasses.replace(cfg, moe_intermediate_size=33), 2)
    if kind == "qwen2_moe":  # layer 1 is dense: intermediate_size must divide too
        with pytest.raises(ValueError, match="tensor_parallel_size=2 does not divide the "
                                             "model's shared_expert_intermediate_size 81"):
            check_tensor_parallel(dataclasses.replace(cfg, shared_expert_intermediate_size=81), 2)
        with pytest.raises(ValueError, match="does not divide the model's intermediate_size 97"):
            check_tensor_parallel(dataclasses.replace(cfg, intermediate_size=97), 2)
    else:  # every layer sparse: the dense width is never used, so it need not divide
        check_tensor_parallel(dataclasses.replace(cfg, intermediate_size=97), 2)
    # The driver refuses from config.json alone, before it starts any process.
    hf = json.loads((path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(hf | {"moe_intermediate_size": 17}))
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match="tensor_parallel_size=2 does not divide the model's "
                                         "moe_intermediate_size 17"):
        LLM(str(tmp_path), tensor_parallel_size=2, **_kw("eager"))
    assert set(multiprocessing.active_children()) == before


def test_moe_ranks_read_their_expert_slices_and_the_shards_make_the_model(moe):
    """Each rank reads half of every routed and shared expert tensor (gate and up rows, down
    columns), the whole router and shared-expert gate; the shards join into the model."""
    _, path = moe
    cfg, _ = load_model_config(str(path))
    files = checkpoint_files(path)
    full = dict(load_model(cfg, path, "auto", torch.float32, torch.device("cpu"), 0)
                .named_parameters())
    shape = {n: s.get_shape() for n, s in iter_checkpoint_slices(files)}
    shards = []
    for rank in range(2):
        reads: dict = {}
        model = build_empty(shard_config(cfg, 2), torch.float32, torch.device("cpu"),
                            TensorParallel(rank, 2, None, cfg.num_kv_heads))
        load_weights(model, ((n, _SpySlice(n, s, reads))
                             for n, s in iter_checkpoint_slices(files)), cfg)
        shards.append(dict(model.named_parameters()))
        for name, indices in reads.items():
            if ".mlp.experts." in name or ".mlp.shared_expert." in name:
                assert len(indices) == 1, name
                read = [len(range(*i.indices(d))) for i, d in zip(indices[0], shape[name])]
                assert 2 * math.prod(read) == math.prod(shape[name]), (name, read)
            elif name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                assert len(indices) == 1 and indices[0] == (slice(None),) * 2, name
    local = shard_config(cfg, 2)
    for i in range(cfg.num_layers):
        if not cfg.is_moe_layer(i):
            continue
        p = f"layers.{i}.moe."
        packed = [("experts_gate_up", local.moe_intermediate_size, 1)]
        if local.shared_expert_intermediate_size:
            packed.append(("shared_gate_up.weight", local.shared_expert_intermediate_size, 0))
        for name, width, dim in packed:  # [gate_0 | up_0], [gate_1 | up_1] -> [gate | up]
            gate = torch.cat([s[p + name].narrow(dim, 0, width) for s in shards], dim)
            up = torch.cat([s[p + name].narrow(dim, width, width) for s in shards], dim)
            assert torch.equal(torch.cat([gate, up], dim), full[p + name])
        assert torch.equal(torch.cat([s[p + "experts_down"] for s in shards], 2),
                           full[p + "experts_down"])
        assert torch.equal(shards[1][p + "gate.weight"], full[p + "gate.weight"])
        if local.shared_expert_intermediate_size:
            assert torch.equal(torch.cat([s[p + "shared_down.weight"] for s in shards], 1),
                               full[p + "shared_down.weight"])
            assert torch.equal(shards[1][p + "shared_expert_gate.weight"],
                               full[p + "shared_expert_gate.weight"])


@pytest.mark.parametrize("kind", ["qwen2_moe", "qwen3_moe"])
def test_moe_tp2_matches_tp1(moe_checkpoints, moe_tp1_tokens, kind):
    """Sharded experts, the router replicated, one all-reduce per MoE layer: TP=2 follows
    TP=1's greedy tokens through the graph stand-in (checks, poisoned padding) and eagerly
    (the prefill chunks above the top tier run eagerly: ``fallbacks``)."""
    with LLM(str(moe_checkpoints[kind]), tensor_parallel_size=2, **_kw("ragged")) as llm:
        assert _tokens(llm) == moe_tp1_tokens[kind]
        g = llm.graph_stats()
        assert sum(g["hits"].values()) >= 5 and g["checks"] >= 5
        assert g["fallbacks"]


class _ThreadGroup:
    """An in-process all-reduce between threads (one a rank) that counts each rank's calls."""

    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size)
        self.parts: list = [None] * size
        self.calls = [0] * size

    def all_reduce(self, rank: int, x: torch.Tensor) -> torch.Tensor:
        self.calls[rank] += 1
        self.parts[rank] = x.clone()
        self.barrier.wait()
        total = sum(self.parts)  # the same order on every rank
        self.barrier.wait()
        return x.copy_(total)


@dataclasses.dataclass(frozen=True)
class _ThreadTP(TensorParallel):
    threads: _ThreadGroup | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self.threads.all_reduce(self.rank, x)


def test_an_moe_layer_all_reduces_once_after_both_branches(moe):
    """A sparse layer's "after" part on two ranks calls two all-reduces (o_proj, then the
    whole MoE block: routed + gated shared partial sums), and their output is the
    unsharded layer's."""
    _, path = moe
    cfg, _ = load_model_config(str(path))
    cpu = torch.device("cpu")
    full = load_model(cfg, path, "auto", torch.float32, cpu, 0)
    threads = _ThreadGroup(2)
    ranks = [load_model(shard_config(cfg, 2), path, "auto", torch.float32, cpu, 0,
                        _ThreadTP(r, 2, None, cfg.num_kv_heads, threads=threads), cfg)
              for r in range(2)]
    g = torch.Generator().manual_seed(0)
    attn = torch.randn(5, cfg.num_heads, cfg.head_dim, generator=g)
    residual = torch.randn(5, cfg.hidden_size, generator=g)
    heads = cfg.num_heads // 2
    layer = next(i for i in range(cfg.num_layers) if cfg.is_moe_layer(i))
    with torch.inference_mode():
        want, _ = full.layers[layer].after(attn, residual.clone())
        got: list = [None, None]

        def run(r: int) -> None:
            with torch.inference_mode():
                got[r], _ = ranks[r].layers[layer].after(
                    attn[:, r * heads:(r + 1) * heads].contiguous(), residual.clone())

        workers = [threading.Thread(target=run, args=(r,)) for r in range(2)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(timeout=60)
    assert threads.calls == [2, 2]
    for out in got:
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
