"""``LLM.resize_kv_cache`` on the CPU: the pool grows and shrinks under its reserved range
(``max_num_kv_blocks``) with every KV tensor, address and graph unchanged; outputs stay token
for token the same; blocks at or above the size are never handed out; a shrink refuses while
a request holds a block above it and evicts prefix-cached ones; bad sizes are ``ValueError``."""

from __future__ import annotations

import pytest
import torch

from replaylm import LLM, SamplingParams
from replaylm.engine.block_manager import BlockManager
from replaylm.engine.request import Request
from replaylm.graphs.audit import AddressBook
from replaylm.memory.arena import Arena

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
LONG = [3 + (11 * j) % 250 for j in range(34)]
PROMPTS = [LONG, [5, 9, 200, 17, 4, 80, 33], LONG + [7, 8], [9] * 20]


def _llm(mode: str = "ragged", **extra) -> LLM:
    kw = dict(device="cpu", num_kv_blocks=16, max_num_kv_blocks=64, max_num_seqs=4,
              max_num_batched_tokens=48, max_model_len=48, skip_tokenizer_init=True,
              attention_backend="torch_dense", enable_prefix_caching=True)
    if mode == "eager":
        kw |= dict(enforce_eager=True)
    else:
        kw |= dict(cuda_graph_mode=mode, graph_tiers="4,16", max_graph_tokens=16,
                   graph_check=2, poison_padding=True)
    return LLM("default", **(kw | extra))


def _tokens(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def _graphs(llm: LLM) -> dict:
    return {k: llm.graph_stats()[k] for k in ("num_graphs", "nodes", "capture_seconds")}


@pytest.fixture(scope="module")
def ragged() -> LLM:
    return _llm()


def test_resize_down_and_up_keeps_addresses_graphs_and_outputs(ragged):
    llm, core = ragged, ragged.engine
    runner = core.runner
    before = _tokens(llm)
    ptrs = [(k.data_ptr(), v.data_ptr(), k.stride()) for k, v in runner.kv_caches]
    graphs = _graphs(llm)
    assert runner.kv_capacity == 64 and runner.kv_caches[0][0].shape[0] == 64

    grown = llm.resize_kv_cache(64)
    assert (grown.previous_blocks, grown.num_blocks, grown.max_num_blocks) == (16, 64, 64)
    assert grown.mapped_bytes == 64 * runner.layer_block_bytes * 2 * runner.cfg.num_layers
    assert grown.audit is not None and grown.audit["graphs"] == graphs["num_graphs"]
    assert core.block_manager.num_free_blocks == 63 and core.stats.kv_blocks_total == 63
    assert _tokens(llm) == before

    shrunk = llm.resize_kv_cache(5)  # max_model_len 48 needs 3 blocks + the scratch block
    assert shrunk.num_blocks == 5 and shrunk.mapped_bytes * 64 == grown.mapped_bytes * 5
    assert _tokens(llm) == before  # four requests in a pool of four blocks: they take turns

    llm.resize_kv_cache(16)
    assert _tokens(llm) == before
    assert [(k.data_ptr(), v.data_ptr(), k.stride()) for k, v in runner.kv_caches] == ptrs
    assert _graphs(llm) == graphs, "a resize must not recapture"
    core.scheduler.check_integrity()


def test_blocks_above_the_size_are_never_handed_out(ragged):
    llm, core = ragged, ragged.engine
    llm.resize_kv_cache(9)
    seen: set[int] = set()
    prompts = [[7 + i, *LONG[: 10 + 5 * i]] for i in range(6)]
    for i, p in enumerate(prompts):
        core.add_request(f"r{i}", p, GREEDY)
    while core.has_unfinished():
        core.step()
        seen.update(b for r in core.scheduler.holders for b in r.block_ids)
        core.scheduler.check_integrity()
    assert seen and max(seen) < 9, f"handed out {sorted(seen)}"
    # Bytes past the mapped part of each segment are poisoned on the CPU (NaN): had any
    # kernel read them, the outputs below would not match the full pool's.
    k0 = core.runner.kv_caches[0][0]
    assert torch.isnan(k0[9 + 16:]).all()
    small = _tokens(llm)
    llm.resize_kv_cache(64)
    assert _tokens(llm) == small
    llm.resize_kv_cache(16)


def test_shrink_refuses_held_blocks_and_evicts_cached_ones(ragged):
    llm, core = ragged, ragged.engine
    bm = core.block_manager
    llm.reset_prefix_cache()
    # Which blocks the two get depends on what the module's engine served before (the free
    # list's order); b's prompt shares no block with a's, so each leaves full blocks cached.
    core.add_request("a", LONG, GREEDY)  # 3 blocks
    core.add_request("b", [1, 2, 3] + LONG[:30], GREEDY)  # 3 blocks, none shared with a
    core.step()
    held = {r.request_id: list(r.block_ids) for r in core.scheduler.holders}
    top = max(b for ids in held.values() for b in ids)
    with pytest.raises(RuntimeError, match="hold blocks above it"):
        llm.resize_kv_cache(top)
    assert bm.num_blocks == 16 and core.runner.num_blocks == 16  # nothing changed
    while core.has_unfinished():
        core.step()
    # a and b held 6 blocks, so at least 3 of them were blocks 4 or above, and each request
    # left 2 full blocks cached.
    above = {b for b in bm.cache.entries if b >= 4}
    assert bm.num_cached_blocks == 4 and above
    report = llm.resize_kv_cache(4)
    assert report.evicted_blocks == len(above)
    assert all(b < 4 for b in bm.cache.entries) and bm.num_cached_blocks == 4 - len(above)
    core.scheduler.check_integrity()
    llm.resize_kv_cache(16)


def test_bad_sizes_and_pools_that_cannot_resize(ragged):
    llm = ragged
    for bad in (1, 65, 3, 2.5, True):  # 3: max_model_len 48 needs 4 blocks
        with pytest.raises(ValueError, match="num_blocks"):
            llm.resize_kv_cache(bad)
    assert llm.engine.runner.num_blocks == 16
    plain = _llm("eager", max_num_kv_blocks=None)
    assert plain.engine.runner.arena is None
    with pytest.raises(ValueError, match="max_num_kv_blocks"):
        plain.resize_kv_cache(8)
    with pytest.raises(ValueError, match="num_kv_blocks=16 is invalid"):
        _llm("eager", max_num_kv_blocks=8)


def test_sleep_mode_pool_resizes_and_sleeps_with_its_size():
    llm = _llm("eager", max_num_kv_blocks=None, enable_sleep_mode=True)
    core = llm.engine
    before = _tokens(llm)
    assert core.runner.kv_capacity == 16  # without max_num_kv_blocks: the start-up size
    with pytest.raises(ValueError, match=r"\[2, 16\]"):
        llm.resize_kv_cache(17)
    llm.resize_kv_cache(6)
    kv = core.runner.arena.regions["kv"]
    report = llm.sleep(1)
    assert report.kv_bytes == kv.chunk_bytes == 6 * core.runner.layer_block_bytes * 2 * \
        core.runner.cfg.num_layers
    with pytest.raises(RuntimeError, match="asleep"):
        llm.resize_kv_cache(16)
    llm.wake_up()
    assert _tokens(llm) == before
    llm.resize_kv_cache(16)
    assert _tokens(llm) == before


def test_segmented_region_keeps_kept_bytes_zeroes_new_ones_poisons_the_rest():
    arena = Arena(torch.device("cpu"))
    region = arena.segmented("r", 3, 100, 40)
    assert region.segment == 100 and region.chunk_bytes == 120
    for j in range(3):
        region.bytes[j * 100: j * 100 + 40].fill_(j + 1)
    region.fit(25)
    assert region.chunk_bytes == 75 and region.spans() == [(0, 25), (100, 125), (200, 225)]
    region.fit(60)
    for j in range(3):
        seg = region.bytes[j * 100: j * 100 + 100]
        assert (seg[:25] == j + 1).all() and (seg[25:60] == 0).all() and (seg[60:] == 255).all()
    assert arena.locate(region.ptr + 70)[2] is None  # reserved, no chunk
    region.release()
    with pytest.raises(RuntimeError, match="released"):
        region.fit(10)


def test_audit_judges_a_tail_word_only_if_it_was_mapped_at_capture():
    """A resizable pool reserves far more than it maps: a word in an unmapped tail that was
    unmapped at capture too is an integer (no replay used it); one mapped at capture and
    unmapped since dangles."""
    arena = Arena(torch.device("cpu"))
    region = arena.segmented("kv", 2, 100, 60)
    at_capture = arena.mapped_ranges()
    assert at_capture == [(region.ptr, region.ptr + 60), (region.ptr + 100, region.ptr + 160)]
    region.fit(20)  # shrunk after capture
    book = AddressBook(arena, mapped_at_capture=at_capture)
    assert book.check(region.ptr + 10) == (True, None)  # mapped now
    assert book.check(region.ptr + 80) == (False, None)  # never mapped since capture
    known, why = book.check(region.ptr + 150)  # mapped at capture, unmapped since
    assert known and "not mapped" in why
    assert AddressBook(arena).check(region.ptr + 80)[1] is not None  # capture unknown


def _req(rid: str, n: int) -> Request:
    return Request(rid, list(range(n)), SamplingParams(), arrival=0, seed=0)


def test_block_manager_resize():
    bm = BlockManager(6, enable_prefix_caching=True)
    a = _req("a", 32)
    assert bm.allocate(a, 32) and a.block_ids == [1, 2]
    bm.resize(10)
    b = _req("b", 64)
    assert bm.allocate(b, 64) and b.block_ids == [3, 4, 5, 6], "old free blocks go first"
    with pytest.raises(RuntimeError, match=r"blocks \[5, 6\] above it are held"):
        bm.resize(5)
    assert bm.num_blocks == 10
    bm.free(b)
    assert bm.resize(5) == 0 and bm.num_free_blocks == 2
    assert not bm.allocate(_req("c", 48), 48)
    bm.check_integrity([a])
    with pytest.raises(ValueError, match="num_blocks >= 2"):
        bm.resize(1)


def test_tensor_parallel_ranks_resize_together():
    kw = dict(device="cpu", num_kv_blocks=16, max_num_kv_blocks=32, max_num_seqs=4,
              max_num_batched_tokens=48, max_model_len=48, skip_tokenizer_init=True,
              enforce_eager=True, distributed_timeout_s=120.0)
    with LLM("default", tensor_parallel_size=2, **kw) as llm:
        before = _tokens(llm)
        report = llm.resize_kv_cache(32)
        assert (report.previous_blocks, report.num_blocks) == (16, 32)
        with pytest.raises(ValueError, match="num_blocks"):
            llm.resize_kv_cache(33)
        assert _tokens(llm) == before
        assert llm.resize_kv_cache(5).num_blocks == 5  # the followers' pools shrink too
        assert _tokens(llm) == before
