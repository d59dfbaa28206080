"""Grouping a step's (token, expert) assignments by expert for the grouped MoE kernels
(``kernels.moe``), in tiles of ``block_m`` slots.

The ``A = T·k`` assignments of ``topk_ids`` ``[T, k]`` (flat index ``t·k + j``) are laid out
expert by expert, each expert's in increasing flat index and padded to whole tiles; the
number of tiles is the host-known bound :func:`max_tiles`, so a capture at a tier serves any
routing, and the tiles past the last expert's are marked empty.

* :func:`align_reference` — torch ops (a stable sort, prefix sums, a scatter): the
  reference, and the path above ``MAX_KERNEL_ASSIGNMENTS``.
* :func:`align_kernel` — one Triton launch of ``E + 1`` programs with the reference's
  output, bit for bit. Program ``e < E`` counts every expert's assignments (a histogram per
  chunk of ``CHUNK`` ids), takes its expert's first slot from the prefix sum of the padded
  counts, and writes its assignments' slots in flat order (a prefix sum of matches per
  chunk), its last tile's empty slots and its tiles' expert id; program ``E`` marks the
  empty tiles past the last expert's. Every slot and tile is written by exactly one
  program, with no atomics: replays are deterministic.

Graph safe either way: no host sync, shapes from ``A``, ``E`` and ``block_m`` only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Most assignments :func:`align` groups with :func:`align_kernel`; above, each of its
#: ``E + 1`` programs reads the ids twice in ``A / CHUNK`` sequential chunks while
#: :func:`align_reference`'s launches (a dozen) each spread over the GPU.
MAX_KERNEL_ASSIGNMENTS = 8192
#: Assignment ids :func:`align_kernel` reads per step of its loops.
CHUNK = 1024


def max_tiles(num_assignments: int, num_experts: int, block_m: int) -> int:
    """Tiles any routing of ``num_assignments`` over ``num_experts`` can fill: the sum over
    used experts of ``ceil(count / block_m)`` is at most ``A // block_m + min(E, A)``."""
    return num_assignments // block_m + min(num_experts, num_assignments)


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int,
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Group the assignments ``topk_ids`` ``[T, k]`` by expert in tiles of ``block_m``.

    Returns ``slot_rows`` ``[tiles · block_m]`` (int32: the flat assignment ``t·k + j`` in
    each slot, ``T·k`` for an empty one) and ``tile_expert`` ``[tiles]`` (int32: the
    tile's expert, -1 past the last used tile), ``tiles`` = :func:`max_tiles`: one launch
    (:func:`align_kernel`) up to ``MAX_KERNEL_ASSIGNMENTS``, torch ops above.
    """
    if topk_ids.numel() <= MAX_KERNEL_ASSIGNMENTS:
        return align_kernel(topk_ids, num_experts, block_m)
    return align_reference(topk_ids, num_experts, block_m)


def align_reference(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`align` in torch ops."""
    flat = topk_ids.flatten()
    a = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    first = counts.cumsum(0) - counts  # each expert's first position in expert order
    order = torch.sort(flat, stable=True).indices  # assignments in expert order
    experts = flat[order]
    slots = padded_end[experts] - padded[experts] + torch.arange(a, device=flat.device) \
        - first[experts]
    tiles = max_tiles(a, num_experts, block_m)
    slot_rows = torch.full((tiles * block_m,), a, dtype=torch.int32, device=flat.device)
    slot_rows.scatter_(0, slots, order.to(torch.int32))
    starts = torch.arange(tiles, device=flat.device) * block_m
    tile_expert = torch.searchsorted(padded_end, starts, right=True)
    tile_expert = torch.where(tile_expert < num_experts, tile_expert, -1).to(torch.int32)
    return slot_rows, tile_expert


@triton.jit
def _align_kernel(ids_ptr, slot_rows_ptr, tile_expert_ptr, num_assign, num_tiles,
                  NUM_EXPERTS: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                  CHUNK: tl.constexpr):
    """Program ``e < E``: expert ``e``'s slots and tiles; program ``E``: the empty tiles
    past the last expert's (``E_PAD``: ``E`` to the next power of two)."""
    e = tl.program_id(0)
    lanes = tl.arange(0, CHUNK)
    experts = tl.arange(0, E_PAD)
    counts = tl.zeros((E_PAD,), dtype=tl.int32)
    for a0 in range(0, num_assign, CHUNK):
        offs = a0 + lanes
        valid = offs < num_assign
        ids = tl.load(ids_ptr + offs, mask=valid, other=0).to(tl.int32)
        counts += tl.histogram(ids, E_PAD, mask=valid)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    if e < NUM_EXPERTS:
        mine = experts == e
        start = tl.sum(tl.where(mine, ends - padded, 0))
        count = tl.sum(tl.where(mine, counts, 0))
        size = tl.sum(tl.where(mine, padded, 0))
        pos = start  # the next slot of this expert
        for a0 in range(0, num_assign, CHUNK):
            offs = a0 + lanes
            hit = tl.load(ids_ptr + offs, mask=offs < num_assign, other=-1) == e
            hits = hit.to(tl.int32)
            tl.store(slot_rows_ptr + pos + tl.cumsum(hits, 0) - 1, offs, mask=hit)
            pos += tl.sum(hits)
        pad = count + tl.arange(0, BLOCK_M)
        tl.store(slot_rows_ptr + start + pad, num_assign, mask=pad < size)
        for j0 in range(0, size // BLOCK_M, CHUNK):
            j = j0 + lanes
            tl.store(tile_expert_ptr + start // BLOCK_M + j, e, mask=j < size // BLOCK_M)
    else:
        used = tl.sum(padded)
        for j0 in range(used // BLOCK_M, num_tiles, CHUNK):
            j = j0 + lanes
            tl.store(tile_expert_ptr + j, -1, mask=j < num_tiles)
        for s0 in range(used, num_tiles * BLOCK_M, CHUNK):
            s = s0 + lanes
            tl.store(slot_rows_ptr + s, num_assign, mask=s < num_tiles * BLOCK_M)


def align_kernel(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`align` in one launch (``E + 1`` programs)."""
    a = topk_ids.numel()
    tiles = max_tiles(a, num_experts, block_m)
    slot_rows = torch.empty(tiles * block_m, dtype=torch.int32, device=topk_ids.device)
    tile_expert = torch.empty(tiles, dtype=torch.int32, device=topk_ids.device)
    if a == 0:
        return slot_rows, tile_expert
    _align_kernel[(num_experts + 1,)](
        topk_ids.contiguous(), slot_rows, tile_expert, a, tiles, NUM_EXPERTS=num_experts,
        E_PAD=triton.next_power_of_2(num_experts), BLOCK_M=block_m, CHUNK=CHUNK)
    return slot_rows, tile_expert
