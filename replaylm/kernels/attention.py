"""Paged, varlen, causal attention over the front-packed batch, in Triton.

One launch serves any mix of prefill chunks (over a cached prefix), single-token decodes,
multi-token verify rows, padded tokens and empty request slots, and never reads a length on
the host, so a CUDA graph can capture it.

Work decomposition (graph safe: the grid depends only on the padded token count ``T``, the
slot count ``S`` and head counts):

* A program owns one *tile* of ``BQ`` consecutive query tokens of one request and one KV
  head. The query heads sharing that KV head (the GQA group, padded to ``G_PAD``) are
  stacked into the tile's rows, so ``BLOCK_M = BQ * G_PAD`` and every K/V block is read once
  per group instead of once per query head.
* Request ``i`` owns tiles ``tile_start[i] .. tile_start[i+1]`` where
  ``tile_start[i] = cu_seqlens_q[i] // BQ + i``. That gives every request at least
  ``ceil(q_len / BQ)`` tiles and bounds the total by ``T // BQ + S``, a host-known number.
  A program finds its request by counting ``tile_start[i] <= tile`` on device; surplus
  tiles exit at once.
* One extra tile per grid (``+1``) lets the "sink" tiles past ``tile_start[S]`` zero the
  rows of padded tokens ``cu_seqlens_q[S] .. T``, so padded rows are deterministic (a graph
  check comparing replay against eager sees identical buffers) and never NaN.
* Split-KV (flash-decoding): a third grid axis of fixed size ``num_splits`` cuts each
  request's context into equal BLOCK_N-aligned ranges; splits past the context exit at once.
  When one split covers the whole context it writes the output directly. Otherwise each
  writes an un-normalised partial output plus its running max / sum, then counts itself in
  with an atomic; the last of the tile's splits to arrive merges them (``_merge_splits``)
  and resets the counter. So split-KV is one launch, with no combine kernel (and no extra
  graph node) per layer. The split count comes from host-known sizes only, so a graph tier
  always picks the same path; the merge order is fixed, so results do not depend on which
  split arrives last.
* Decode with the rotary work inside (``rope``; decode steps of at most
  ``EngineArgs.rope_in_attention_max_reqs`` requests in whole-model graphs) is the
  latency-critical variant, so more of its work happens before the PDL wait, while the qkv
  projection still runs: programs without keys leave, and the others load their first key
  block (every key but the step's new one was written by earlier steps) and patch the new
  key in after the wait. Its merge loads ``ROPE_MERGE_BATCH`` partials per round trip.

The Triton programs live in ``kernels.attention_kernel``; this module picks the variant and
launches it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
import triton

from replaylm.batch import BLOCK_SIZE
from replaylm.kernels import pdl
from replaylm.kernels.attention_kernel import LOG2E, _paged_attn_kernel
from replaylm.kernels.rope import RotaryArgs

MAX_SPLITS = 32  # upper bound on the split-KV axis
#: Fewest keys a split takes (the bandwidth tile's default; ``AttnConfig.min_split_keys``):
#: below it, merging partials costs more than it saves, so short contexts run as one split
#: (no merge) even when the grid has more. The latency tile merges from 64 keys.
MIN_SPLIT_KEYS = 256
#: Merge counters per device: split-KV runs only while requests x KV heads < SM count and
#: queries are <= 16 per request, so tiles x KV heads stays far below this.
MAX_SPLIT_TILES = 8192
#: Most query tokens in one short (decode / verify) tile: see :func:`pick_config`.
MAX_SHORT_TOKENS = 16
_SEARCH_CHUNK = 128  # request slots examined per step of the on-device tile lookup


@dataclass(frozen=True, kw_only=True)
class RopeInputs(RotaryArgs):
    """What the rotary kernel (``elementwise.rotary``) would do before attention, done by the attention launch itself
    (decode steps: at most one new token per request). ``q`` is then the raw q projection;
    the kernel normalises (Qwen3's q/k norm) and rotates it, and the program that holds a
    request's newest key position normalises and rotates the new key and stores it and its
    value at ``slot_mapping``. ``k``/``v`` are the raw ``[T, Hkv, D]`` projections (any row
    and head strides, contiguous last dim)."""

    k: torch.Tensor
    v: torch.Tensor


@dataclass(frozen=True)
class AttnConfig:
    """Tile shape and launch parameters of one attention kernel variant."""

    block_m: int  # rows per tile = query tokens per tile x padded GQA group
    block_n: int  # keys per inner iteration (a multiple of the 16-token page)
    num_warps: int
    num_stages: int
    min_split_keys: int = MIN_SPLIT_KEYS  # fewest keys per split-KV range


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def group_pad(num_heads: int, num_kv_heads: int) -> int:
    """The GQA group padded to a power of two (the tile stacks this many heads per token)."""
    return _next_pow2(num_heads // num_kv_heads)


def pick_config(max_q_len: int, g_pad: int, head_dim: int, latency_bound: bool = False,
                ) -> AttnConfig:
    """Tile configuration from host-known bounds only (deterministic for a graph tier).

    Decode / verify launches (a few tokens per request) take a short tile so no work is
    wasted on absent query rows. With many (request, KV head) pairs they are memory bound
    and take long key blocks, so each program keeps plenty of K/V bytes in flight. With
    fewer pairs than SMs (``latency_bound``, see :func:`few_programs`) and 128-wide heads
    they take the latency tile: 64-key blocks, one stage, and splits from 64 keys, so
    split-KV spreads even a short context over more programs. Larger launches take the
    prefill tile. A short tile holds at most ``MAX_SHORT_TOKENS`` query tokens: a ``ragged``
    graph's launch is sized for a prefill chunk as long as its tier (``max_q_len`` = the
    tier) but mostly runs decode steps, one query row per request, and taller tiles would
    compute that many empty rows for each of them; a chunk takes one tile per
    ``MAX_SHORT_TOKENS`` of its tokens instead. The numbers come from sweeps on an H200
    (``benchmarks/kernels.py --sweep``): 128-key blocks with 4 warps read at ~4.3 TB/s;
    64x64 tiles with 4 warps, 2 stages gave the best causal prefill. At batch 1 with
    Qwen3-0.6B's 128-wide heads (contexts 64-288) the latency tile averaged 5.2 µs against
    7.7 µs for the bandwidth tile and made decode about 5% faster; with Llama-3.2-1B's
    64-wide heads it made decode about 1% slower, so narrower heads keep the bandwidth
    tile.
    """
    tokens = _next_pow2(max(1, max_q_len))
    if g_pad * tokens <= 64:
        small_m = max(16, g_pad * min(tokens, MAX_SHORT_TOKENS))
        if latency_bound and head_dim >= 128:
            return AttnConfig(block_m=small_m, block_n=64, num_warps=4, num_stages=1,
                              min_split_keys=64)
        return AttnConfig(block_m=small_m, block_n=128 if head_dim <= 128 else 64, num_warps=4,
                          num_stages=2)
    return AttnConfig(block_m=max(64, g_pad), block_n=64, num_warps=4, num_stages=2)


def few_programs(q: torch.Tensor, num_reqs: int, num_kv_heads: int) -> bool:
    """Whether a launch has fewer (request slot, KV head) pairs than the device has SMs, so
    one program per pair would leave SMs idle: latency, not bandwidth, bounds it."""
    sms = _sm_count(q.device.index or 0) if q.is_cuda else 132
    return num_reqs * num_kv_heads < sms


@cache
def _split_counters(device: torch.device) -> torch.Tensor:
    """Per-(tile, KV head) arrival counters of the split-KV merge, zero between launches (the
    merging program resets its own). One buffer per device, allocated at warmup: attention
    launches of one device run on one stream, so they never share it concurrently."""
    return torch.zeros(MAX_SPLIT_TILES, dtype=torch.int32, device=device)


@cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def pick_num_splits(q: torch.Tensor, num_reqs: int, num_kv_heads: int, max_q_len: int,
                    max_kv_len: int, block_n: int, min_split_keys: int = MIN_SPLIT_KEYS) -> int:
    """Split-KV factor from host-known sizes: split only when few (request, KV head) pairs
    would leave most SMs idle over a long context. Deterministic for fixed tier bounds."""
    if max_q_len > 16 or max_kv_len < 2 * block_n or not few_programs(q, num_reqs, num_kv_heads):
        return 1
    sms = _sm_count(q.device.index or 0) if q.is_cuda else 132
    programs = max(1, num_reqs * num_kv_heads)
    splits = min(MAX_SPLITS, triton.cdiv(2 * sms, programs),
                 triton.cdiv(max_kv_len, max(2 * block_n, min_split_keys)))
    return max(1, splits)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    *,
    max_q_len: int,
    max_kv_len: int,
    num_splits: int | None = None,
    min_split_keys: int | None = None,
    config: AttnConfig | None = None,
    out: torch.Tensor | None = None,
    rope: RopeInputs | None = None,
) -> torch.Tensor:
    """Causal paged varlen attention of the packed batch; returns ``[T, Hq, D]``.

    ``q``: ``[T, Hq, D]`` (any row/head strides, contiguous last dim); caches
    ``[num_blocks, 16, Hkv, D]``; ``cu_seqlens_q`` ``[S+1]`` int32, ``kv_lens`` ``[S]`` int32,
    ``block_table`` ``[S, max_blocks]`` int32, all on the device. ``max_q_len`` /
    ``max_kv_len`` are host upper bounds; they pick the kernel variant and the split count
    (``num_splits`` overrides the latter), never the grid's request lookup. A split takes at
    least ``min_split_keys`` keys (a multiple of the key block; by default the tile's own), so
    a short context is one split however many the grid has. With ``rope`` (decode steps,
    ``max_q_len == 1``) the launch also does the rotary kernel's work (``RopeInputs``). Rows
    of padded tokens come back as zeros. No host sync.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    num_reqs = kv_lens.shape[0]
    assert k_cache.shape[1] == BLOCK_SIZE and num_heads % num_kv_heads == 0
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"Triton attention needs a power-of-two head_dim >= 16, got {head_dim}")
    group = num_heads // num_kv_heads
    g_pad = _next_pow2(group)
    cfg = config or pick_config(max_q_len, g_pad, head_dim,
                                few_programs(q, num_reqs, num_kv_heads))
    bq = cfg.block_m // g_pad
    if min_split_keys is None:
        min_split_keys = cfg.min_split_keys
    if num_splits is None:
        num_splits = pick_num_splits(q, num_reqs, num_kv_heads, max_q_len, max_kv_len,
                                     cfg.block_n, min_split_keys)
    num_splits = max(1, min(int(num_splits), MAX_SPLITS))
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    is_split = num_splits > 1
    if is_split:
        part_o = torch.empty(num_tokens, num_heads, num_splits, head_dim, device=q.device,
                             dtype=torch.float32)
        part_ml = torch.empty(num_tokens, num_heads, num_splits, 2, device=q.device,
                              dtype=torch.float32)
    else:
        part_o = part_ml = out  # unused
    if rope is not None:
        if max_q_len != 1:
            raise ValueError(f"rotary inside attention needs max_q_len == 1, got {max_q_len}")
        assert rope.k.stride(-1) == 1 and rope.v.stride(-1) == 1
        assert (rope.q_norm_weight is None) == (rope.k_norm_weight is None)
        has_norm = rope.q_norm_weight is not None
        rope_args = (rope.k, rope.v, rope.positions, rope.cos_sin,
                     rope.q_norm_weight if has_norm else rope.cos_sin,
                     rope.k_norm_weight if has_norm else rope.cos_sin, rope.slot_mapping,
                     rope.eps)
        rope_strides = (rope.k.stride(0), rope.k.stride(1), rope.v.stride(0), rope.v.stride(1),
                        rope.cos_sin.stride(0))
    else:
        has_norm = False
        rope_args = (q, q, cu_seqlens_q, q, q, q, cu_seqlens_q, 0.0)  # never read
        rope_strides = (0, 0, 0, 0, 0)
    min_split = triton.cdiv(min_split_keys, cfg.block_n) * cfg.block_n
    grid = (num_tokens // bq + num_reqs + 1, num_kv_heads, num_splits)
    counters = _split_counters(q.device)
    if is_split and grid[0] * grid[1] > counters.numel():
        raise ValueError(f"split-KV attention over {grid[0]} tiles x {grid[1]} KV heads exceeds "
                         f"the {counters.numel()} merge counters")
    _paged_attn_kernel[grid](
        q, k_cache, v_cache, out, part_o, part_ml, counters,
        cu_seqlens_q, kv_lens, block_table, *rope_args,
        scale * LOG2E, num_tokens, num_reqs, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0),
        *rope_strides,
        GROUP=group, G_PAD=g_pad, BQ=bq, BLOCK_N=cfg.block_n, HEAD_DIM=head_dim,
        PAGE=BLOCK_SIZE, IS_SPLIT=is_split, MIN_SPLIT=min_split, ROPE=rope is not None,
        HAS_QK_NORM=has_norm, CHUNK=_SEARCH_CHUNK, USE_PDL=pdl.ENABLED,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.LAUNCH,
    )
    return out
