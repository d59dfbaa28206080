"""Paged KV-cache block allocator: pure CPU bookkeeping with reference counts.

Block 0 is the scratch block that padded tokens write (DESIGN.md), so it is never handed out.
Blocks carry reference counts so that several requests can hold the same block (n > 1 forks,
later prefix caching); a block returns to the free pool when its count drops to zero.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from replaylm.attention.backend import BLOCK_SIZE
from replaylm.engine.request import Request

SCRATCH_BLOCK = 0


class BlockManager:
    """Hands out KV blocks ``1 .. num_blocks - 1`` to requests and tracks who holds what.

    The free pool is a LIFO stack, initialised so that block 1 comes out first: deterministic,
    and a block freed a moment ago (still warm in cache) is the next one reused.
    A request's ``block_ids`` cover its first ``len(block_ids) * block_size`` token positions.
    """

    def __init__(self, num_blocks: int, block_size: int = BLOCK_SIZE) -> None:
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

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - 1 - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-max(num_tokens, 0) // self.block_size)

    def num_blocks_needed(self, req: Request, num_tokens: int) -> int:
        """Extra blocks ``req`` needs so that its blocks cover ``num_tokens`` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(req.block_ids))

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, req: Request, num_tokens: int) -> bool:
        """Grow ``req.block_ids`` to cover ``num_tokens`` tokens; all or nothing."""
        need = self.num_blocks_needed(req, num_tokens)
        if need > len(self._free):
            return False
        for _ in range(need):
            block = self._free.pop()
            self._refcount[block] = 1
            req.block_ids.append(block)
        return True

    def free(self, req: Request) -> None:
        """Drop every block ``req`` holds; idempotent."""
        self._release(req.block_ids)
        req.block_ids = []

    def truncate(self, req: Request, num_tokens: int) -> None:
        """Keep only the blocks covering ``num_tokens`` tokens (speculative-decoding rollback)."""
        keep = self.blocks_for(num_tokens)
        if keep < len(req.block_ids):
            self._release(req.block_ids[keep:])
            del req.block_ids[keep:]
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
                self._free.append(block)

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


def _require(ok: bool, message: str) -> None:
    # Explicit raise rather than `assert`, so the check also runs under `python -O`.
    if not ok:
        raise AssertionError(f"BlockManager integrity: {message}")
