"""Automatic prefix caching: verified hits, sharing, LRU eviction, and unchanged outputs."""

from __future__ import annotations

import pytest
import torch

from replaylm import LLM, SamplingParams
from replaylm.engine import prefix_cache
from replaylm.engine.block_manager import BlockManager
from replaylm.engine.request import Request

BS = 4


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(), 0, 0)


def _compute(bm: BlockManager, req: Request) -> None:
    """Pretend a step computed all of ``req``'s tokens (after any cached prefix)."""
    assert bm.allocate(req, req.num_tokens)
    req.num_computed_tokens = req.num_tokens
    bm.register(req)


def test_hit_shares_blocks_and_keeps_one_token_to_compute() -> None:
    bm = BlockManager(16, block_size=BS, enable_prefix_caching=True)
    a = _req("a", list(range(10, 22)))  # 12 tokens: 3 full blocks
    assert bm.match_prefix(a) == 0
    _compute(bm, a)
    b = _req("b", list(range(10, 22)))
    # Same 12 tokens: only 2 blocks reused, so the last token is computed and sampled.
    assert bm.match_prefix(b) == 8 and b.block_ids == a.block_ids[:2]
    c = _req("c", list(range(10, 19)) + [99, 98, 97, 96])
    assert bm.match_prefix(c) == 8
    bm.check_integrity([a, b, c])
    assert bm._refcount[a.block_ids[0]] == 3
    bm.free(a)
    bm.free(b)
    bm.free(c)
    bm.check_integrity([])
    assert bm.num_used_blocks == 0 and bm.num_cached_blocks == 3
    assert bm.cache.hit_rate == 0.0  # record_query is the scheduler's call


def test_hits_are_verified_not_trusted_to_the_hash(monkeypatch) -> None:
    monkeypatch.setattr(prefix_cache, "chain_hash", lambda parent, tokens: 42)
    import replaylm.engine.block_manager as bm_mod

    monkeypatch.setattr(bm_mod, "chain_hash", lambda parent, tokens: 42)
    bm = BlockManager(16, block_size=BS, enable_prefix_caching=True)
    a = _req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    _compute(bm, a)
    # Every block collides on the hash; different tokens must never hit.
    other = _req("o", [1, 2, 3, 4, 0, 0, 0, 0, 9])
    assert bm.match_prefix(other) == 0  # the index holds a's 2nd block under hash 42
    same_first = _req("f", [9, 9, 9, 9, 5, 6, 7, 8, 1])
    assert bm.match_prefix(same_first) == 0
    bm.free(other)
    bm.free(same_first)
    bm.check_integrity([a])


def test_lru_eviction_only_when_free_blocks_run_out() -> None:
    bm = BlockManager(7, block_size=BS, enable_prefix_caching=True)  # 6 usable
    reqs = []
    for i in range(3):
        r = _req(str(i), [i * 10 + j for j in range(8)])  # 2 full blocks
        bm.match_prefix(r)
        _compute(bm, r)
        bm.free(r)
        reqs.append(r)
        bm.check_integrity([])
    assert bm.num_free_blocks == 6 and bm.num_cached_blocks == 6
    again = _req("again", [j for j in range(8)] + [5])  # request 0's prefix: a hit
    assert bm.match_prefix(again) == 8
    bm.free(again)  # request 0's blocks are now the most recently used
    big = _req("big", list(range(100, 116)))  # needs 4 blocks: evicts requests 1 and 2
    assert bm.allocate(big, 16)
    bm.check_integrity([big])
    assert bm.num_cached_blocks == 2
    assert bm.match_prefix(_req("x", [j for j in range(8)] + [5])) == 8


def test_truncate_uncaches_blocks_that_will_be_rewritten() -> None:
    bm = BlockManager(8, block_size=BS, enable_prefix_caching=True)
    a = _req("a", list(range(1, 12)))
    _compute(bm, a)
    assert len(a.block_hashes) == 2
    bm.truncate(a, 5)
    assert len(a.block_hashes) == 1 and bm.num_cached_blocks == 1
    bm.check_integrity([a])


# Engine -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tests.conftest import make_checkpoint

    path = tmp_path_factory.mktemp("prefix-llama")
    make_checkpoint("llama", path, seed=21)
    return path


def _traffic(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(3, 256, (37,), generator=g).tolist()
    prompts = []
    for i in range(8):
        tail = torch.randint(3, 256, (int(torch.randint(1, 12, (1,), generator=g)),),
                             generator=g).tolist()
        prompts.append(system + tail if i % 4 else system[:20] + tail)
    prompts += [prompts[1], prompts[2]]  # exact repeats
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=14,
                             ignore_eos=True) for i in range(len(prompts))]
    return prompts, params


def _run(llm: LLM, prompts, params, waves: int = 2) -> list[list[int]]:
    """Submit the prompts in waves (later waves hit what earlier ones cached)."""
    core = llm.engine
    got: dict[str, list[int]] = {}
    shared_seen = False
    per_wave = -(-len(prompts) // waves)
    for w in range(waves):
        for i in range(w * per_wave, min(len(prompts), (w + 1) * per_wave)):
            core.add_request(str(i), prompts[i], params[i])
            got[str(i)] = []
        while core.has_unfinished():
            for d in core.step():
                got[d.request_id].extend(d.new_token_ids)
            core.scheduler.check_integrity()
            bm = core.block_manager
            shared_seen |= any(c > 1 for c in bm._refcount)
    assert core.block_manager.num_used_blocks == 0
    llm.shared_seen = shared_seen
    return [got[str(i)] for i in range(len(prompts))]


def test_cached_runs_match_cold_runs(ckpt) -> None:
    prompts, params = _traffic()
    cold = LLM(str(ckpt), num_kv_blocks=256, skip_tokenizer_init=True,
               enable_prefix_caching=False)
    want = _run(cold, prompts, params)
    assert cold.stats().prefix_cache_hit_tokens == 0
    warm = LLM(str(ckpt), num_kv_blocks=256, skip_tokenizer_init=True)
    assert _run(warm, prompts, params) == want
    s = warm.stats()
    assert s.prefix_cache_hit_tokens >= 32 * 4 and warm.shared_seen
    assert 0 < s.prefix_cache_hit_rate < 1 and s.kv_blocks_cached > 0
    # A repeated prompt skips its prefill: the whole prompt but its last block is reused.
    hits = s.prefix_cache_hit_tokens
    warm.generate([prompts[3]], params[3], use_tqdm=False)
    assert warm.stats().prefix_cache_hit_tokens - hits == (len(prompts[3]) - 1) // 16 * 16


def test_small_pool_evicts_and_preempts_but_stays_correct(ckpt) -> None:
    prompts, params = _traffic(1)
    cold = LLM(str(ckpt), num_kv_blocks=256, skip_tokenizer_init=True,
               enable_prefix_caching=False)
    want = _run(cold, prompts, params, waves=3)
    tiny = LLM(str(ckpt), num_kv_blocks=9, max_num_seqs=4, max_num_batched_tokens=16,
               max_model_len=128, skip_tokenizer_init=True)
    assert _run(tiny, prompts, params, waves=3) == want
    s = tiny.stats()
    assert s.preemptions > 0 and s.prefix_cache_hit_tokens > 0 and s.prefix_cache_evictions > 0
