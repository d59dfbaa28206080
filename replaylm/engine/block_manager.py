"""Paged KV-cache block allocator: pure CPU bookkeeping with reference counts.

Block 0 is the scratch block that padded tokens write (``replaylm.batch``), so it is never handed out.
Blocks carry reference counts so that several requests can hold the same block (n > 1
siblings, prefix caching); a block returns to the free pool when its count drops to zero. With
prefix caching, a full block is registered in a ``PrefixCache`` once its K/V are computed; when
its count drops to zero it stays cached (evictable, still counted as free) until the allocator
runs out of plain free blocks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from replaylm.batch import BLOCK_SIZE
from replaylm.engine.prefix_cache import ROOT_HASH, PrefixCache, chain_hash, prefix_root
from replaylm.engine.request import Request

SCRATCH_BLOCK = 0
# A request's block hash after ``drop_cached_blocks``: a serial no cache entry has, so the
# blocks chained from it are never reached by a lookup (which walks from the root).
STALE = (ROOT_HASH ^ 0x57A1E, -1)


class BlockManager:
    """Hands out KV blocks ``1 .. num_blocks - 1`` to requests and tracks who holds what.

    The free pool is a LIFO stack, initialised so that block 1 comes out first: deterministic,
    and a block freed a moment ago (still warm in cache) is the next one reused.
    A request's ``block_ids`` cover its first ``len(block_ids) * block_size`` token positions.
    """

    def __init__(self, num_blocks: int, block_size: int = BLOCK_SIZE,
                 enable_prefix_caching: bool = False) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"BlockManager needs num_blocks >= 2 (block 0 is reserved scratch), got {num_blocks}"
            )
        if block_size < 1:
            raise ValueError(f"BlockManager needs block_size >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._refcount = [0] * num_blocks
        # Stack: pop() from the end, so reverse order makes the lowest id the first handed out.
        self._free: list[int] = list(range(num_blocks - 1, SCRATCH_BLOCK, -1))
        self.cache: PrefixCache | None = PrefixCache() if enable_prefix_caching else None

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: plain free ones plus unheld cached ones."""
        return len(self._free) + (len(self.cache.evictable) if self.cache else 0)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - 1 - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Registered blocks, held or not."""
        return len(self.cache.entries) if self.cache else 0

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-max(num_tokens, 0) // self.block_size)

    def num_blocks_needed(self, req: Request, num_tokens: int) -> int:
        """Extra blocks ``req`` needs so that its blocks cover ``num_tokens`` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(req.block_ids))

    def allocate(self, req: Request, num_tokens: int) -> bool:
        """Grow ``req.block_ids`` to cover ``num_tokens`` tokens; all or nothing."""
        if num_tokens <= len(req.block_ids) * self.block_size:
            return True  # the common decode step: the last block still has room
        need = self.num_blocks_needed(req, num_tokens)
        if need > self.num_free_blocks:
            return False
        for _ in range(need):
            # Plain free blocks first: a cached block is only evicted when nothing else is left.
            block = self._free.pop() if self._free else self._evict()
            self._refcount[block] = 1
            req.block_ids.append(block)
        return True

    def _evict(self) -> int:
        """The least recently used cached block, taken out of the cache (``allocate`` calls
        it only when ``num_free_blocks`` counts evictable blocks, so a cache exists)."""
        assert self.cache is not None
        return self.cache.pop_lru()

    def free(self, req: Request) -> None:
        """Drop every block ``req`` holds; idempotent."""
        self._release(req.block_ids)
        req.block_ids = []
        req.block_hashes = []

    def truncate(self, req: Request, num_tokens: int) -> None:
        """Keep only the blocks covering ``num_tokens`` tokens (speculative-decoding rollback)."""
        keep = self.blocks_for(num_tokens)
        full = max(num_tokens, 0) // self.block_size
        if self.cache is not None and len(req.block_hashes) > full:
            # Blocks from ``full`` on will be rewritten: they must leave the cache first.
            for b in req.block_ids[full:keep]:
                if b in self.cache.entries:
                    _require(self._refcount[b] == 1, f"truncate rewrites shared block {b}")
                    self.cache.forget(b)
            stale = req.block_hashes[0] == STALE
            del req.block_hashes[full:]
            if stale and not req.block_hashes:
                req.block_hashes.append(STALE)  # its first block's K/V stays unregistered
        if keep < len(req.block_ids):
            self._release(req.block_ids[keep:])
            del req.block_ids[keep:]
        req.table_len = min(req.table_len, len(req.block_ids))
        req.num_computed_tokens = min(req.num_computed_tokens, max(num_tokens, 0))

    def share(self, src: Request, dst: Request) -> int:
        """Make ``dst`` hold ``src``'s full computed blocks that it can reuse; returns tokens shared.

        Only whole blocks are shared: the partial tail block would be written by both requests.
        The shared prefix is limited to tokens both requests agree on, and to
        ``dst.num_tokens - 1`` so that ``dst`` still computes at least one token (it needs the
        logits of its last known token to sample). ``dst.num_computed_tokens`` is set to the
        shared length so that nothing ever writes into a shared block.
        """
        if dst.block_ids:
            raise ValueError(f"share: destination {dst.request_id!r} already holds blocks")
        limit = min(src.num_computed_tokens, dst.num_tokens - 1)
        common = 0
        while common < limit and src.token_at(common) == dst.token_at(common):
            common += 1
        num_full = min(common // self.block_size, len(src.block_ids))
        for block in src.block_ids[:num_full]:
            self._refcount[block] += 1
            dst.block_ids.append(block)
        dst.num_computed_tokens = num_full * self.block_size
        return dst.num_computed_tokens

    def slot(self, req: Request, pos: int) -> int:
        """KV-cache slot of token position ``pos`` of ``req``."""
        return req.block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def _release(self, blocks: list[int]) -> None:
        # Push in reverse so that the request's first block is the next one popped.
        for block in reversed(blocks):
            self._refcount[block] -= 1
            if self._refcount[block] == 0:
                if self.cache is not None and block in self.cache.entries:
                    self.cache.evictable[block] = None  # most recently used end
                else:
                    self._free.append(block)

    def resize(self, num_blocks: int) -> int:
        """Hand out blocks ``1 .. num_blocks - 1`` from now on. Growing adds the new blocks to
        the free pool (handed out after the ones free already); shrinking forgets the
        prefix-cached blocks at or above ``num_blocks`` (none may be held: ``RuntimeError``
        naming them, the pool unchanged). Returns the cached blocks evicted."""
        if num_blocks < 2:
            raise ValueError(f"BlockManager needs num_blocks >= 2 (block 0 is reserved "
                             f"scratch), got {num_blocks}")
        old = self.num_blocks
        if num_blocks >= old:
            self._refcount.extend([0] * (num_blocks - old))
            self._free[:0] = range(num_blocks - 1, old - 1, -1)  # the bottom of the stack
            self.num_blocks = num_blocks
            return 0
        held = [b for b in range(num_blocks, old) if self._refcount[b]]
        if held:
            raise RuntimeError(f"cannot shrink the KV pool to {num_blocks} blocks: blocks "
                               f"{held[:8]}{' ...' if len(held) > 8 else ''} above it are held "
                               "by requests (finish or abort them first)")
        evicted = 0
        if self.cache is not None:
            for b in range(num_blocks, old):
                if b in self.cache.entries:
                    self.cache.forget(b)
                    evicted += 1
        self._free = [b for b in self._free if b < num_blocks]
        del self._refcount[num_blocks:]
        self.num_blocks = num_blocks
        return evicted

    # Prefix caching --------------------------------------------------------------------------

    def match_prefix(self, req: Request) -> int:
        """Give a block-less ``req`` the cached blocks of its longest cached prefix.

        At most ``req.num_tokens - 1`` tokens are reused, so at least the last known token is
        computed and the step samples. Sets ``num_computed_tokens`` and ``block_hashes``;
        returns the tokens reused. Counts the query in the hit-rate statistics.
        """
        if req.block_ids:
            raise ValueError(f"match_prefix: {req.request_id!r} already holds blocks")
        req.block_hashes = []
        req.num_computed_tokens = 0
        cache = self.cache
        if cache is None:
            return 0
        bs = self.block_size
        tokens = req.all_token_ids
        parent, parent_serial = prefix_root(req.lora_int_id)
        for i in range((req.num_tokens - 1) // bs):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            h = chain_hash(parent, chunk)
            e = cache.lookup(h, chunk, parent_serial)
            if e is None:
                break
            block = cache.block_of(e)
            if self._refcount[block] == 0:
                del cache.evictable[block]
            self._refcount[block] += 1
            req.block_ids.append(block)
            req.block_hashes.append((h, e.serial))
            parent, parent_serial = h, e.serial
        req.num_computed_tokens = len(req.block_ids) * bs
        return req.num_computed_tokens

    def record_query(self, req: Request, hit_tokens: int) -> None:
        """Count one admission's prompt in the hit-rate statistics (queried vs reused tokens)."""
        if self.cache is not None:
            self.cache.queried_tokens += req.num_tokens
            self.cache.hit_tokens += hit_tokens

    def register(self, req: Request) -> None:
        """Register ``req``'s newly completed full blocks (all their K/V computed)."""
        cache = self.cache
        if cache is None:
            return
        bs = self.block_size
        # Pending samples (overlap scheduling) are computed but not known yet: not hashable.
        done = min(req.num_computed_tokens, req.num_known_tokens)
        full = min(done // bs, len(req.block_ids))
        if full <= len(req.block_hashes):
            return  # the common case: no block completed since the last call
        parent, parent_serial = (req.block_hashes[-1] if req.block_hashes
                                 else prefix_root(req.lora_int_id))
        for i in range(len(req.block_hashes), full):
            chunk = tuple(req.token_slice(i * bs, (i + 1) * bs))
            h = chain_hash(parent, chunk)
            block = req.block_ids[i]
            serial, displaced = cache.insert(block, h, chunk, parent_serial)
            if displaced is not None and displaced in cache.evictable:
                del cache.evictable[displaced]
                self._free.append(displaced)
            req.block_hashes.append((h, serial))
            parent, parent_serial = h, serial

    def drop_cached_blocks(self, live: Iterable[Request] = ()) -> int:
        """Forget every cached block (their K/V came from weights that changed): each one no
        request holds goes back to the plain free pool, each held one stays with its holders
        but is never matched again. ``live`` (every request that holds blocks) stop
        registering theirs: the blocks they hold now, and those that chain from them, hold
        K/V partly computed before the change. Returns the blocks freed."""
        cache = self.cache
        if cache is None:
            return 0
        freed = list(cache.evictable)
        for b in list(cache.entries):
            cache.forget(b)
        self._free.extend(reversed(freed))
        for req in live:
            req.block_hashes = [STALE] * len(req.block_ids)
        return len(freed)

    def check_integrity(self, requests: Iterable[Request]) -> None:
        """Raise ``AssertionError`` naming the first inconsistency between pool and requests.

        ``requests`` must be every live request (all holders of blocks).
        """
        refs: Counter[int] = Counter()
        for req in requests:
            blocks = req.block_ids
            for b in blocks:
                _require(
                    0 <= b < self.num_blocks, f"{req.request_id!r} holds out-of-range block {b}"
                )
                _require(b != SCRATCH_BLOCK, f"{req.request_id!r} holds scratch block 0")
            dup = [b for b, c in Counter(blocks).items() if c > 1]
            _require(not dup, f"{req.request_id!r} holds blocks {dup} more than once")
            need = self.blocks_for(req.num_computed_tokens)
            _require(
                len(blocks) >= need,
                f"{req.request_id!r} has {req.num_computed_tokens} computed tokens but holds "
                f"{len(blocks)} blocks (< {need})",
            )
            refs.update(blocks)

        free_dup = [b for b, c in Counter(self._free).items() if c > 1]
        _require(not free_dup, f"blocks {free_dup} appear more than once in the free list")
        free = set(self._free)
        if self.cache is not None:
            self._check_cache(free)
            free |= set(self.cache.evictable)
        _require(SCRATCH_BLOCK not in free, "scratch block 0 is in the free list")
        _require(
            self._refcount[SCRATCH_BLOCK] == 0,
            f"scratch block 0 has refcount {self._refcount[SCRATCH_BLOCK]}",
        )
        for b in free:
            _require(0 < b < self.num_blocks, f"free list holds out-of-range block {b}")
            _require(self._refcount[b] == 0, f"free block {b} has refcount {self._refcount[b]}")
            _require(refs[b] == 0, f"free block {b} is held by {refs[b]} request(s)")
        used = {b for b in range(1, self.num_blocks) if self._refcount[b] != 0}
        both = sorted(free & used)
        _require(not both, f"blocks {both} are both free and used")
        for b in range(1, self.num_blocks):
            _require(
                self._refcount[b] == refs[b],
                f"block {b} has refcount {self._refcount[b]} but {refs[b]} live reference(s)",
            )
        _require(
            len(free) + len(used) == self.num_blocks - 1,
            f"{len(free)} free + {len(used)} used != {self.num_blocks - 1} usable blocks "
            f"(leaked: {sorted(set(range(1, self.num_blocks)) - free - used)})",
        )


    def _check_cache(self, plain_free: set[int]) -> None:
        cache = self.cache
        assert cache is not None
        for b in cache.evictable:
            _require(b in cache.entries, f"evictable block {b} is not registered")
            _require(self._refcount[b] == 0, f"evictable block {b} has refcount {self._refcount[b]}")
            _require(b not in plain_free, f"block {b} is both evictable and plain free")
        for b in cache.entries:
            _require(0 < b < self.num_blocks, f"cache holds out-of-range block {b}")
            _require(b not in plain_free, f"registered block {b} is in the plain free list")
            _require(self._refcount[b] > 0 or b in cache.evictable,
                     f"unheld registered block {b} is not evictable")
        for h, b in cache.by_hash.items():
            _require(b in cache.entries and cache.entries[b].hash == h,
                     f"hash index points at block {b}, which is not registered under it")


def _require(ok: bool, message: str) -> None:
    # Explicit raise rather than `assert`, so the check also runs under `python -O`.
    if not ok:
        raise AssertionError(f"BlockManager integrity: {message}")
