"""In-place weight updates (``LLM.update_weights``): an engine on checkpoint A updated to B
generates what a fresh engine on B does, with its buffers and graphs untouched; a bad
tensor changes nothing; MoE, tensor parallel and draft models update too."""

from __future__ import annotations

import random

import pytest
import torch
from safetensors.torch import load_file

from replaylm import LLM, SamplingParams
from replaylm.engine.block_manager import BlockManager
from replaylm.engine.loading import load_model_config
from replaylm.engine.request import Request
from replaylm.model.loader import checkpoint_files, load_model
from replaylm.model.weight_map import WeightMap

GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
# The first prompt fills two 16-token blocks and comes twice: the second run reuses the
# first's cached prefix.
LONG = [3 + (11 * j) % 250 for j in range(34)]
PROMPTS = [LONG, [5, 9, 200, 17, 4, 80, 33], LONG + [7, 8]]


def _kw(mode: str) -> dict:
    kw = dict(num_kv_blocks=16, max_num_seqs=4, max_num_batched_tokens=48, max_model_len=48,
              skip_tokenizer_init=True, attention_backend="torch_dense",
              enable_prefix_caching=True)
    if mode == "eager":
        return kw | dict(enforce_eager=True)
    return kw | dict(cuda_graph_mode=mode, graph_tiers="4,16", max_graph_tokens=16,
                     graph_check=3, poison_padding=True)


def _tokens(llm: LLM) -> list[list[int]]:
    out = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    out += llm.generate(PROMPTS[2:], GREEDY, use_tqdm=False)  # a prefix-cache hit on LONG
    return [o.outputs[0].token_ids for o in out]


def _pairs(path) -> list[tuple[str, torch.Tensor]]:
    return [kv for f in checkpoint_files(path) for kv in load_file(str(f)).items()]


def _loaded(path) -> dict[str, torch.Tensor]:
    """The parameters a fresh load of ``path`` makes."""
    cfg, _ = load_model_config(str(path))
    return load_model(cfg, path, "auto", torch.float32, torch.device("cpu"), 0).state_dict()


def _checkpoints(tmp_path_factory, kind: str, **overrides):
    from tests.conftest import make_checkpoint

    paths = []
    for seed in (1, 2):
        path = tmp_path_factory.mktemp(f"upd-{kind}-{seed}")
        make_checkpoint(kind, path, seed=seed, **overrides)
        paths.append(path)
    return paths


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """Qwen2: qkv biases, tied embeddings, one KV head; A and B, and each one's tokens."""
    a, b = _checkpoints(tmp_path_factory, "qwen2")
    return a, b, _tokens(LLM(str(a), **_kw("eager"))), _tokens(LLM(str(b), **_kw("eager")))


@pytest.mark.parametrize("mode", ["eager", "ragged"])
def test_update_matches_a_fresh_engine_in_place_and_without_recapture(qwen2, mode):
    a, b, tokens_a, tokens_b = qwen2
    assert tokens_a != tokens_b
    llm = LLM(str(a), **_kw(mode))
    core = llm.engine
    assert _tokens(llm) == tokens_a
    params = dict(core.runner.model.named_parameters())
    ptrs = {n: p.data_ptr() for n, p in params.items()}
    graphs = {k: llm.graph_stats()[k] for k in ("num_graphs", "nodes", "capture_seconds")}
    assert core.block_manager.num_cached_blocks > 0
    assert core.stats.prefix_cache_hit_tokens > 0

    done = llm.update_weights(str(b))  # a directory
    assert done.tensors == len(_pairs(b)) and done.bytes > 0 and done.seconds > 0
    assert core.block_manager.num_cached_blocks == 0
    core.scheduler.check_integrity()
    assert _tokens(llm) == tokens_b

    # Back to A: its tensors as float64 (cast exactly), shuffled, in two calls.
    pairs = [(n, t.double()) for n, t in _pairs(a)]
    random.Random(0).shuffle(pairs)
    first = llm.update_weights(pairs[:7])
    second = llm.update_weights(dict(pairs[7:]))
    assert first.tensors + second.tensors == len(pairs)
    assert _tokens(llm) == tokens_a

    assert {n: p.data_ptr() for n, p in core.runner.model.named_parameters()} == ptrs
    assert all(p is params[n] for n, p in core.runner.model.named_parameters())
    stats = llm.graph_stats()
    assert {k: stats[k] for k in graphs} == graphs  # nothing captured again
    if mode != "eager":
        assert sum(stats["hits"].values()) > 0 and stats["checks"] > 0


def test_a_bad_tensor_is_named_and_nothing_is_applied(qwen2):
    a, b, tokens_a, _ = qwen2
    llm = LLM(str(a), **_kw("eager"))
    assert _tokens(llm) == tokens_a
    cached = llm.engine.block_manager.num_cached_blocks
    good = _pairs(b)  # every tensor of B: any applied one would change the output
    name, t = good[3]
    cases = [
        ("model.layers.0.self_attn.nonsense.weight", good + [
            ("model.layers.0.self_attn.nonsense.weight", t)]),
        ("model.layers.9.mlp.up_proj.weight", good + [("model.layers.9.mlp.up_proj.weight", t)]),
        (name, good[:3] + [(name, t[..., :-1].clone())] + good[4:]),  # shape
        (name, good[:3] + [(name, t.to(torch.int32))] + good[4:]),  # dtype
    ]
    for bad, source in cases:
        with pytest.raises(ValueError, match=f"{bad}.*(no place|shape|dtype)"):
            llm.update_weights(source)
    with pytest.raises(ValueError, match="not a checkpoint directory"):
        llm.update_weights(str(a / "missing"))
    with pytest.raises(ValueError, match="target='drafts' is invalid"):
        llm.update_weights(str(b), target="drafts")
    with pytest.raises(ValueError, match="needs a draft model"):
        llm.update_weights(str(b), target="draft")
    assert llm.engine.block_manager.num_cached_blocks == cached  # the cache stays valid
    assert _tokens(llm) == tokens_a


def test_moe_experts_update_into_their_packed_tensors(tmp_path_factory):
    a, b = _checkpoints(tmp_path_factory, "qwen2_moe")
    llm = LLM(str(a), **_kw("eager"))
    pairs = _pairs(b)
    random.Random(1).shuffle(pairs)
    assert sum(".experts." in n for n, _ in pairs) > 0
    done = llm.update_weights(pairs)
    assert done.tensors == len(pairs)
    assert _tokens(llm) == _tokens(LLM(str(b), **_kw("eager")))
    # Every parameter (packed experts, gate | up, the shared expert) equals a load of B.
    ref = _loaded(b)
    for n, p in llm.engine.runner.model.state_dict().items():
        assert torch.equal(p, ref[n]), n


def test_tensor_parallel_ranks_update_their_slices(tmp_path_factory):
    # Biased o_proj and MLP: row-parallel biases live on rank 0 alone.
    a, b = _checkpoints(tmp_path_factory, "llama", attention_bias=True, mlp_bias=True)
    kw = _kw("eager") | dict(distributed_timeout_s=120.0)
    tokens_b = _tokens(LLM(str(b), **kw))
    with LLM(str(a), tensor_parallel_size=2, **kw) as llm:
        tokens_a = _tokens(llm)
        assert tokens_a != tokens_b
        pairs = _pairs(b)
        with pytest.raises(ValueError, match="model.layers.0.mlp.gate_proj.weight.*shape"):
            llm.update_weights([(n, t[:-1] if n == "model.layers.0.mlp.gate_proj.weight"
                                 else t) for n, t in pairs])
        assert _tokens(llm) == tokens_a  # neither rank applied any of it
        random.Random(2).shuffle(pairs)
        done = llm.update_weights(pairs[:5])
        done2 = llm.update_weights(pairs[5:])
        assert done.tensors + done2.tensors == len(pairs)
        assert _tokens(llm) == tokens_b
        llm.update_weights(str(a))  # a directory: each rank reads its slices
        assert _tokens(llm) == tokens_a


def test_draft_model_updates_apart_from_the_target(qwen2, tmp_path_factory):
    a, b, tokens_a, _ = qwen2
    spec = {"method": "draft_model", "model": str(a), "num_speculative_tokens": 3}
    llm = LLM(str(a), speculative_config=spec, **_kw("eager"))
    draft = llm.engine.drafter.runner.model
    target = llm.engine.runner.model
    before = {n: p.clone() for n, p in target.state_dict().items()}
    cached = llm.engine.block_manager.num_cached_blocks
    done = llm.update_weights(str(b), target="draft")
    assert done.tensors == len(_pairs(b))
    ref = _loaded(b)
    for n, p in draft.state_dict().items():
        assert torch.equal(p, ref[n]), n
    for n, p in target.state_dict().items():
        assert torch.equal(p, before[n]), n
    assert llm.engine.block_manager.num_cached_blocks == cached
    # Greedy verification keeps the target's tokens whatever the draft proposes.
    assert _tokens(llm) == tokens_a
    assert llm.spec_stats()["acceptance_rate"] < 1.0


def test_drop_cached_blocks_frees_unheld_and_unregisters_held_blocks():
    bs = 4
    bm = BlockManager(16, block_size=bs, enable_prefix_caching=True)

    def computed(rid: str, tokens: list[int]) -> Request:
        req = Request(rid, tokens, SamplingParams(), 0, 0)
        bm.match_prefix(req)
        assert bm.allocate(req, req.num_tokens)
        req.num_computed_tokens = req.num_tokens
        bm.register(req)
        return req

    held = computed("held", list(range(10, 22)))  # 3 full blocks
    gone = computed("gone", list(range(50, 59)))  # 2 full blocks, then freed
    bm.free(gone)
    assert bm.num_cached_blocks == 5 and bm.num_free_blocks == 15 - 3
    assert bm.drop_cached_blocks([held]) == 2
    assert bm.num_cached_blocks == 0 and bm.num_free_blocks == 15 - 3
    bm.check_integrity([held])
    again = Request("again", list(range(10, 22)), SamplingParams(), 0, 0)
    assert bm.match_prefix(again) == 0  # no hit on the held blocks' old K/V
    # The held request's blocks never register, and those it fills later are never reached.
    bm.register(held)
    assert bm.num_cached_blocks == 0
    held.output_token_ids.extend([1, 2, 3, 4])
    assert bm.allocate(held, 16)
    held.num_computed_tokens = 16
    bm.register(held)
    longer = Request("longer", list(range(10, 22)) + [1, 2, 3, 4, 5], SamplingParams(), 0, 0)
    assert bm.match_prefix(longer) == 0
    bm.check_integrity([held])
    bm.free(held)
    bm.check_integrity([])
    assert bm.num_free_blocks == 15


def test_weight_map_names_what_has_no_place(qwen2):
    a = qwen2[0]
    model = LLM(str(a), **_kw("eager")).engine.runner.model
    weights = WeightMap(model)
    assert weights.place("lm_head.weight") is None  # tied: the embedding is the head
    place = weights.place("model.layers.1.self_attn.k_proj.bias")
    assert place.pname == "layers.1.qkv_proj.bias" and place.shard == 1
    assert place.dst.data_ptr() != model.layers[1].qkv_proj.bias.data_ptr()  # a view within
    with pytest.raises(ValueError, match="model.layers.x.mlp.up_proj.weight has no place"):
        weights.place("model.layers.x.mlp.up_proj.weight")
