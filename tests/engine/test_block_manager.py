"""CPU-only tests of the paged KV block allocator."""

from __future__ import annotations

import pytest

from replaylm.engine.block_manager import BlockManager
from replaylm.engine.request import Request
from replaylm.sampling_params import SamplingParams


def make_req(rid: str, prompt_len: int = 1, first_token: int = 0) -> Request:
    prompt = [first_token + i for i in range(prompt_len)]
    return Request(rid, prompt, SamplingParams(), arrival=0, seed=0)


def test_rejects_too_small_pool() -> None:
    for n in (-1, 0, 1):
        with pytest.raises(ValueError, match="num_blocks >= 2"):
            BlockManager(n)
    assert BlockManager(2).num_free_blocks == 1


def test_blocks_for_and_needed() -> None:
    bm = BlockManager(10)
    assert [bm.blocks_for(n) for n in (0, 1, 15, 16, 17, 32, 33)] == [0, 1, 1, 1, 2, 2, 3]
    req = make_req("a")
    assert bm.num_blocks_needed(req, 17) == 2
    assert bm.allocate(req, 17)
    assert bm.num_blocks_needed(req, 17) == 0
    assert bm.num_blocks_needed(req, 33) == 1
    assert bm.num_blocks_needed(req, 5) == 0


def test_allocate_grows_and_never_hands_out_block_zero() -> None:
    bm = BlockManager(5)
    req = make_req("a")
    assert bm.allocate(req, 1)
    assert req.block_ids == [1]
    assert bm.allocate(req, 16)  # still one block
    assert req.block_ids == [1]
    assert bm.allocate(req, 64)
    assert sorted(req.block_ids) == [1, 2, 3, 4]
    assert 0 not in req.block_ids
    assert bm.num_free_blocks == 0 and bm.num_used_blocks == 4
    bm.check_integrity([req])


def test_exhaustion_returns_false_and_changes_nothing() -> None:
    bm = BlockManager(4)  # 3 usable
    a, b = make_req("a"), make_req("b")
    assert bm.allocate(a, 32)
    before = list(a.block_ids)
    assert not bm.allocate(b, 17)  # needs 2, only 1 free
    assert b.block_ids == [] and a.block_ids == before
    assert bm.num_free_blocks == 1
    assert not bm.allocate(a, 64)  # needs 2 more
    assert a.block_ids == before
    assert bm.allocate(b, 16)
    bm.check_integrity([a, b])


def test_free_is_idempotent_and_returns_blocks() -> None:
    bm = BlockManager(6)
    a = make_req("a")
    assert bm.allocate(a, 40)
    bm.free(a)
    assert a.block_ids == [] and bm.num_free_blocks == 5
    bm.free(a)
    assert bm.num_free_blocks == 5
    bm.check_integrity([a])


def test_free_list_is_deterministic() -> None:
    def trace() -> list[list[int]]:
        bm = BlockManager(8)
        a, b, c = make_req("a"), make_req("b"), make_req("c")
        bm.allocate(a, 30)
        bm.allocate(b, 20)
        bm.free(a)
        bm.allocate(c, 50)
        return [a.block_ids, b.block_ids, c.block_ids]

    assert trace() == trace()
    assert trace()[1] == [3, 4]


def test_slot() -> None:
    bm = BlockManager(8)
    a, b = make_req("a"), make_req("b")
    bm.allocate(b, 16)  # b takes block 1, so a's blocks start at 2
    bm.allocate(a, 40)
    assert a.block_ids == [2, 3, 4]
    assert bm.slot(a, 0) == 32
    assert bm.slot(a, 15) == 47
    assert bm.slot(a, 16) == 48
    assert bm.slot(a, 39) == 4 * 16 + 7


def test_truncate_frees_tail_and_clamps_computed() -> None:
    bm = BlockManager(8)
    a = make_req("a", prompt_len=50)
    bm.allocate(a, 50)
    a.num_computed_tokens = 50
    bm.truncate(a, 33)
    assert len(a.block_ids) == 3 and a.num_computed_tokens == 33
    bm.truncate(a, 32)
    assert len(a.block_ids) == 2 and a.num_computed_tokens == 32
    bm.truncate(a, 40)  # growing is not truncate's job
    assert len(a.block_ids) == 2 and a.num_computed_tokens == 32
    bm.truncate(a, 0)
    assert a.block_ids == [] and a.num_computed_tokens == 0
    assert bm.num_free_blocks == 7
    bm.check_integrity([a])


def test_share_refcounts_full_blocks_only() -> None:
    bm = BlockManager(10)
    src = make_req("src", prompt_len=40)
    bm.allocate(src, 40)
    src.num_computed_tokens = 40
    dst = make_req("dst", prompt_len=40)
    assert bm.share(src, dst) == 32  # two full blocks; the partial tail is not shared
    assert dst.block_ids == src.block_ids[:2] and dst.num_computed_tokens == 32
    assert bm.num_used_blocks == 3
    bm.check_integrity([src, dst])

    bm.free(src)  # shared blocks stay held by dst
    assert bm.num_used_blocks == 2
    bm.check_integrity([dst])
    bm.free(dst)
    assert bm.num_used_blocks == 0
    bm.check_integrity([])


def test_share_stops_at_divergence_and_keeps_one_token_to_compute() -> None:
    bm = BlockManager(10)
    src = make_req("src", prompt_len=48)
    bm.allocate(src, 48)
    src.num_computed_tokens = 48
    other = make_req("other", prompt_len=48)
    other.prompt_token_ids[20] = 999  # diverges inside block 1
    assert bm.share(src, other) == 16
    same = make_req("same", prompt_len=32)  # fully shareable, but its last token must be computed
    assert bm.share(src, same) == 16
    with pytest.raises(ValueError, match="already holds"):
        bm.share(src, same)
    bm.check_integrity([src, other, same])


# --- planted corruption: every case must trip the integrity check ---


def _healthy() -> tuple[BlockManager, Request, Request]:
    bm = BlockManager(8)
    a, b = make_req("a", 20), make_req("b", 10)
    bm.allocate(a, 20)
    bm.allocate(b, 10)
    a.num_computed_tokens = 20
    bm.check_integrity([a, b])
    return bm, a, b


def test_integrity_catches_double_free() -> None:
    bm, a, b = _healthy()
    bm._free.append(b.block_ids[0])  # freed while still held
    with pytest.raises(AssertionError, match="more than once|refcount|held by"):
        bm.check_integrity([a, b])
    bm, a, b = _healthy()
    held = list(b.block_ids)
    bm.free(b)
    bm._free.append(held[0])  # the same block pushed twice
    with pytest.raises(AssertionError, match="more than once"):
        bm.check_integrity([a, b])


def test_integrity_catches_leaked_refcount() -> None:
    bm, a, b = _healthy()
    bm._refcount[a.block_ids[0]] += 1
    with pytest.raises(AssertionError, match="refcount 2 but 1 live"):
        bm.check_integrity([a, b])
    bm, a, b = _healthy()
    b.block_ids = []  # dropped without free(): its block leaks
    with pytest.raises(AssertionError, match="refcount 1 but 0 live"):
        bm.check_integrity([a, b])


def test_integrity_catches_block_zero_use() -> None:
    bm, a, b = _healthy()
    b.block_ids.append(0)
    with pytest.raises(AssertionError, match="scratch block 0"):
        bm.check_integrity([a, b])
    bm, a, b = _healthy()
    bm._free.append(0)
    with pytest.raises(AssertionError, match="scratch block 0 is in the free list"):
        bm.check_integrity([a, b])


def test_integrity_catches_lost_block_and_short_request() -> None:
    bm, a, b = _healthy()
    bm._free.pop()  # a block vanishes from the pool
    with pytest.raises(AssertionError, match="leaked"):
        bm.check_integrity([a, b])
    bm, a, b = _healthy()
    a.num_computed_tokens = 40  # claims K/V in a block it does not hold
    with pytest.raises(AssertionError, match="holds 2 blocks"):
        bm.check_integrity([a, b])
    bm, a, b = _healthy()
    b.block_ids.append(a.block_ids[0])  # shared without a refcount increment
    with pytest.raises(AssertionError, match="refcount 1 but 2 live"):
        bm.check_integrity([a, b])
    bm, a, b = _healthy()
    a.block_ids.append(a.block_ids[0])
    with pytest.raises(AssertionError, match="more than once"):
        bm.check_integrity([a, b])
