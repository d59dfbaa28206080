"""Sleep and wake (``LLM.sleep``/``wake_up``, ``enable_sleep_mode``) on the CPU: the same API
as on CUDA over plain memory, where sleeping poisons the live weights and KV pool (NaN) so a
stale read shows. Level 1 comes back with the same outputs, addresses and graphs; level 2
comes back ready for ``update_weights``; nothing runs while asleep."""

from __future__ import annotations

import pytest
import torch

from replaylm import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
LONG = [3 + (11 * j) % 250 for j in range(34)]  # two full blocks: cached for the next call
PROMPTS = [LONG, [5, 9, 200, 17, 4, 80, 33], LONG + [7, 8]]


def _kw(mode: str, **extra) -> dict:
    kw = dict(num_kv_blocks=16, max_num_seqs=4, max_num_batched_tokens=48, max_model_len=48,
              skip_tokenizer_init=True, attention_backend="torch_dense",
              enable_prefix_caching=True, enable_sleep_mode=True)
    if mode == "eager":
        return kw | dict(enforce_eager=True) | extra
    return kw | dict(cuda_graph_mode=mode, graph_tiers="4,16", max_graph_tokens=16,
                     graph_check=3, poison_padding=True) | extra


def _tokens(llm: LLM) -> list[list[int]]:
    out = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    out += llm.generate(PROMPTS[2:], GREEDY, use_tqdm=False)  # a prefix-cache hit on LONG
    return [o.outputs[0].token_ids for o in out]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Tiny Qwen2 checkpoints A and B, and a fresh eager engine's tokens on B."""
    from tests.conftest import make_checkpoint

    paths = []
    for seed in (1, 2):
        path = tmp_path_factory.mktemp(f"sleep-{seed}")
        make_checkpoint("qwen2", path, seed=seed)
        paths.append(path)
    a, b = paths
    return a, b, _tokens(LLM(str(b), **_kw("eager", enable_sleep_mode=False)))


def _graphs(llm: LLM) -> dict:
    return {k: llm.graph_stats()[k] for k in ("num_graphs", "nodes", "capture_seconds")}


@pytest.mark.parametrize("mode", ["eager", "ragged"])
def test_level1_wakes_to_the_same_outputs_addresses_and_graphs(ckpts, mode):
    a, _, _ = ckpts
    llm = LLM(str(a), **_kw(mode))
    core = llm.engine
    before = _tokens(llm)
    params = dict(core.runner.model.named_parameters())
    ptrs = {n: p.data_ptr() for n, p in params.items()}
    kv_ptr = core.runner.kv_caches[0][0].data_ptr()
    graphs = _graphs(llm)
    assert core.block_manager.num_cached_blocks > 0

    report = llm.sleep(level=1)
    assert llm.is_sleeping()
    assert report.level == 1 and report.freed_bytes == 0  # the CPU device reports nothing
    assert report.weight_bytes > 0 and report.kv_bytes > 0
    assert report.released_bytes == report.weight_bytes + report.kv_bytes
    assert report.backup_bytes > 0
    assert core.block_manager.num_cached_blocks == 0, "sleep must drop the prefix cache"
    for name, p in params.items():  # a stale read shows: every live weight reads NaN
        assert torch.isnan(p).all(), f"{name} is not poisoned while asleep"
    assert torch.isnan(core.runner.kv_caches[0][0]).all(), "the KV pool is not poisoned"

    wake = llm.wake_up()
    assert not llm.is_sleeping()
    assert wake.level == 1 and wake.restored_bytes == report.backup_bytes
    if mode != "eager":  # graph_check is on: the audit ran
        assert wake.audit is not None and wake.audit["graphs"] == graphs["num_graphs"]
    assert {n: p.data_ptr() for n, p in params.items()} == ptrs
    assert core.runner.kv_caches[0][0].data_ptr() == kv_ptr
    assert not torch.isnan(core.runner.kv_caches[0][0]).any(), "the KV pool must wake zeroed"
    assert core.block_manager.num_cached_blocks == 0
    assert _tokens(llm) == before
    assert _graphs(llm) == graphs, "wake must not recapture"
    core.scheduler.check_integrity()


def test_level2_wakes_for_update_weights_and_equals_a_fresh_engine(ckpts):
    a, b, tokens_b = ckpts
    llm = LLM(str(a), **_kw("ragged"))
    core = llm.engine
    tokens_a = _tokens(llm)
    assert tokens_a != tokens_b
    graphs = _graphs(llm)
    report = llm.sleep(level=2)
    assert report.level == 2 and report.backup_bytes == 0
    with pytest.raises(RuntimeError, match="asleep"):
        llm.update_weights(str(b))
    wake = llm.wake_up()
    assert wake.level == 2 and wake.restored_bytes == 0
    emb = core.runner.model.embed_tokens.weight
    assert torch.isnan(emb).all(), "level 2 keeps no weights: they read NaN until updated"
    update = llm.update_weights(str(b))
    assert update.audit is not None  # graph_check: audited after the update
    assert _tokens(llm) == tokens_b
    assert _graphs(llm) == graphs


def test_nothing_runs_while_asleep_and_no_block_leaks(ckpts):
    a, _, _ = ckpts
    llm = LLM(str(a), **_kw("eager"))
    core = llm.engine
    before = _tokens(llm)
    llm.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    with pytest.raises(RuntimeError, match="asleep"):
        core.add_request("x", PROMPTS[1], GREEDY)
    assert not core.has_unfinished() and not core.requests
    assert core.block_manager.num_used_blocks == 0
    assert core.step() == []
    with pytest.raises(RuntimeError, match="asleep already"):
        llm.sleep(2)
    llm.wake_up()
    with pytest.raises(RuntimeError, match="not asleep"):
        llm.wake_up()
    assert _tokens(llm) == before
    core.scheduler.check_integrity()
    assert core.block_manager.num_used_blocks == 0


def test_sleep_needs_sleep_mode_an_idle_engine_and_a_valid_level(ckpts):
    a, _, _ = ckpts
    plain = LLM(str(a), **_kw("eager", enable_sleep_mode=False))
    with pytest.raises(ValueError, match="enable_sleep_mode"):
        plain.sleep()
    assert not plain.is_sleeping()
    assert plain.engine.runner.arena is None  # nothing changes with it off
    llm = LLM(str(a), **_kw("eager"))
    with pytest.raises(ValueError, match="level"):
        llm.sleep(3)
    llm.engine.add_request("busy", PROMPTS[1], GREEDY)
    with pytest.raises(RuntimeError, match="idle"):
        llm.sleep()
    assert not llm.is_sleeping()
    llm.engine.abort("busy")
    assert llm.reset_prefix_cache() == 0


def test_data_parallel_ranks_sleep_and_wake_through_the_driver(ckpts):
    """``MultiProcessEngine``: every rank sleeps and wakes (worker messages), the driver
    refuses requests meanwhile, and the outputs come back the same."""
    a, _, _ = ckpts
    with LLM(str(a), data_parallel_size=2, **_kw("eager")) as llm:
        before = _tokens(llm)
        report = llm.sleep(1)
        assert llm.is_sleeping() and report.backup_bytes > 0
        with pytest.raises(RuntimeError, match="asleep"):
            llm.engine.add_request("x", PROMPTS[1], GREEDY)
        with pytest.raises(RuntimeError, match="asleep"):
            llm.update_weights(str(a))
        llm.wake_up()
        with pytest.raises(RuntimeError, match="not asleep"):
            llm.wake_up()
        assert _tokens(llm) == before
        assert llm.audit_graphs().graphs == 0  # eager: nothing captured


def test_host_copy_is_allocated_ahead_in_pieces_and_reused(ckpts, monkeypatch):
    from replaylm.memory import sleep as sleep_module

    monkeypatch.setattr(sleep_module, "HOST_PIECE_BYTES", 4096)
    a, _, _ = ckpts
    llm = LLM(str(a), **_kw("eager"))
    sleeper = llm.engine.runner.sleeper
    sleeper.wait_host()  # the start-up thread's work
    region = sleeper.weights[0]
    pieces = sleeper._host[region.name]
    assert len(pieces) == -(-region.nbytes // 4096) > 1
    assert sum(p.numel() for p in pieces) == region.nbytes
    before = _tokens(llm)
    for _ in range(2):
        assert llm.sleep(1).backup_bytes == region.nbytes
        assert llm.wake_up().restored_bytes == region.nbytes
        assert all(x is y for x, y in zip(sleeper._host[region.name], pieces, strict=True))
        assert _tokens(llm) == before
    later = LLM(str(a), **_kw("eager", sleep_pin_ahead=False)).engine.runner.sleeper
    assert later._pinning is None and not later._host  # pinned at the first sleep(1)


def test_a_draft_model_sleeps_and_wakes_with_the_target(ckpts):
    a, b, tokens_b = ckpts
    spec = {"method": "draft_model", "model": str(a), "num_speculative_tokens": 3}
    llm = LLM(str(a), speculative_config=spec, **_kw("eager", graph_check=1))
    core = llm.engine
    target, draft = core.runner, core.drafter.runner
    before = _tokens(llm)
    accepted = llm.spec_stats()["acceptance_rate"]
    assert accepted > 0.5  # the draft is the target: its drafts are accepted
    draft_ptrs = {n: p.data_ptr() for n, p in draft.model.named_parameters()}
    draft_kv = draft.kv_caches[0][0].data_ptr()

    report = llm.sleep(level=1)
    sizes = [r.arena.regions[n].chunk_bytes for r in (target, draft) for n in ("weights", "kv")]
    assert report.released_bytes == sum(sizes)
    assert report.weight_bytes == sizes[0] + sizes[2] and report.kv_bytes == sizes[1] + sizes[3]
    assert draft.sleeper.asleep
    assert all(torch.isnan(p).all() for p in draft.model.parameters())
    assert torch.isnan(draft.kv_caches[0][0]).all()
    wake = llm.wake_up()
    assert not draft.sleeper.asleep and wake.restored_bytes == report.backup_bytes
    assert wake.audit is not None  # graph_check: both models' graphs audited (none: eager)
    assert {n: p.data_ptr() for n, p in draft.model.named_parameters()} == draft_ptrs
    assert draft.kv_caches[0][0].data_ptr() == draft_kv
    assert _tokens(llm) == before

    llm.sleep(level=2)  # then both models take B's weights
    llm.wake_up()
    assert all(torch.isnan(p).all() for p in draft.model.parameters())
    llm.update_weights(str(b))
    llm.update_weights(str(b), target="draft")
    assert _tokens(llm) == tokens_b
    assert llm.spec_stats()["acceptance_rate"] > 0.5  # B's drafts for B's target
    core.scheduler.check_integrity()
