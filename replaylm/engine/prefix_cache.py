"""Automatic prefix caching: an index of full KV blocks by their token prefix.

A full block is keyed by a chained hash, ``h_i = hash((h_{i-1}, tokens of block i))``, so one
lookup per block walks a prompt's prefix. The hash only finds a candidate: a hit also compares
the block's stored tokens and the *serial* of its parent entry (every registration gets a new,
never reused serial). A block is therefore reused only when its own tokens match and its parent
is exactly the entry matched one block earlier, which by induction means the whole prefix
matches: hash collisions can cost a miss, never a wrong hit. A prompt's first block's parent
is its LoRA adapter's root (``prefix_root``), so blocks are never shared across adapters.

Cached blocks with no holder stay in ``evictable`` (least recently released first) and count as
free: the allocator takes plain free blocks first and evicts from here only when none are left.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

ROOT_HASH = 0x5EED_CAC4E  # the "parent hash" of a prompt's first block


def chain_hash(parent_hash: int, tokens: tuple[int, ...]) -> int:
    return hash((parent_hash, tokens))


def prefix_root(lora_int_id: int = 0) -> tuple[int, int]:
    """``(parent hash, parent serial)`` of a prompt's first block. Blocks are keyed by the
    request's LoRA adapter (0: the base model): an adapter's first block has the parent
    serial ``-1 - lora_int_id``, which no entry's serial (always > 0) nor the block
    manager's stale marker (-1) equals, so the same tokens under two adapters never match,
    hash collisions included."""
    if lora_int_id == 0:
        return ROOT_HASH, 0
    return hash((ROOT_HASH, "lora", lora_int_id)), -1 - lora_int_id


@dataclass(frozen=True)
class CacheEntry:
    hash: int
    tokens: tuple[int, ...]
    parent_serial: int  # 0 for a first block
    serial: int


class PrefixCache:
    """Hash index of registered blocks plus the LRU order of the unheld ones."""

    def __init__(self) -> None:
        self.by_hash: dict[int, int] = {}
        self.entries: dict[int, CacheEntry] = {}  # block -> entry
        self.evictable: OrderedDict[int, None] = OrderedDict()
        self._serials = itertools.count(1)
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.evictions = 0

    def lookup(self, h: int, tokens: tuple[int, ...], parent_serial: int) -> CacheEntry | None:
        """The entry for this exact block (tokens and parent verified), or ``None``."""
        block = self.by_hash.get(h)
        if block is None:
            return None
        e = self.entries[block]
        if e.tokens != tokens or e.parent_serial != parent_serial:
            return None
        return e

    def block_of(self, e: CacheEntry) -> int:
        return self.by_hash[e.hash]

    def insert(self, block: int, h: int, tokens: tuple[int, ...],
               parent_serial: int) -> tuple[int, int | None]:
        """Register ``block``; returns ``(serial of the canonical entry, displaced block)``.

        If an identical entry exists (another request computed the same prefix at the same
        time) that one stays canonical and ``block`` is left unregistered. A stale or colliding
        entry under the same hash is displaced; the caller un-caches the displaced block.
        """
        same = self.lookup(h, tokens, parent_serial)
        if same is not None:
            return same.serial, None
        displaced = self.by_hash.get(h)
        if displaced is not None:
            del self.entries[displaced]
        serial = next(self._serials)
        self.by_hash[h] = block
        self.entries[block] = CacheEntry(h, tokens, parent_serial, serial)
        return serial, displaced

    def forget(self, block: int) -> None:
        """Drop ``block``'s entry (it is being evicted or rewritten)."""
        e = self.entries.pop(block, None)
        if e is not None and self.by_hash.get(e.hash) == block:
            del self.by_hash[e.hash]
        self.evictable.pop(block, None)

    def pop_lru(self) -> int:
        """Evict the least recently released unheld block; returns it, un-cached."""
        block, _ = self.evictable.popitem(last=False)
        self.forget(block)
        self.evictions += 1
        return block

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0
