"""Grouped routed experts for MoE layers: the Triton path of ``fused_moe``.

Graph safe: no host sync and no data-dependent shape. The ``T × top_k`` (token, expert)
assignments are grouped by expert on the device (``kernels.moe_align``): each expert's
assignments fill whole tiles of ``BLOCK_M`` slots, and the number of tiles is the host-known
bound ``T·k // BLOCK_M + min(E, T·k)``, so a capture at a tier serves any routing. Tiles past
the last expert's are marked empty and their programs return at once. Each tile then runs
one expert's grouped GEMMs: gate/up with SiLU·mul (``_gate_up_kernel``) into an
intermediate buffer, and down scaled by the routing weight (``_down_kernel``) into one row
per assignment; the ``k`` rows of a token are summed last. A tile reads only its expert's
weights, so a batch-1 decode step reads the ``k`` chosen experts and no other. Four
launches in all: grouping, the two GEMMs, the sum.

Launch shapes are a :class:`GroupedConfig` (``BLOCK_M`` and each kernel's :class:`Tile`):
:func:`pick_config` takes one from ``CONFIGS`` by the routing's mean assignments per
expert; ``benchmarks/moe.py --grouped-sweep`` times the ``BLOCK_MS`` × ``TILE_CANDIDATES``.

Rounding follows ``ref.fused_moe`` (projections accumulate in fp32 and round to the model
dtype, as ``linear`` does); the sum over a token's experts runs in top-k order, not expert
order, so results agree with the reference to rounding, not bit for bit. A row's result
depends on its own inputs only, in a reduction order set by ``BLOCK_K``: two configs agree
to rounding, one config with itself bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch
import triton
import triton.language as tl

from replaylm.kernels.dot import dot
from replaylm.kernels.moe_align import align

#: Slots per tile :class:`GroupedConfig` allows (``tl.dot`` needs at least 16 rows).
BLOCK_MS = (16, 32, 64)


@dataclass(frozen=True)
class Tile:
    """One grouped GEMM's launch: output strips of ``block_n`` columns, reduction chunks of
    ``block_k``, and Triton's ``num_warps`` and ``num_stages`` (software-pipeline depth of
    the chunk loop)."""

    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name}={v}: a power of two >= 16 (tl.dot)")
        if self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ValueError(f"num_warps={self.num_warps}, num_stages={self.num_stages}")

    def fit(self, n: int, k: int) -> Tile:
        """This tile with strips and chunks no longer than ``n`` and ``k`` need (their next
        power of two, 16 at least): the same program on small shapes, without idle lanes."""
        return replace(self, block_n=min(self.block_n, max(16, triton.next_power_of_2(n))),
                       block_k=min(self.block_k, max(16, triton.next_power_of_2(k))))


@dataclass(frozen=True)
class GroupedConfig:
    """The grouped path's launch shapes: ``block_m`` slots per tile (grouping and both
    GEMMs), the gate/up kernel's :class:`Tile` (strips of the ``I`` intermediate columns,
    chunks of ``H``) and the down kernel's (strips of ``H``, chunks of ``I``)."""

    block_m: int = 16
    gate_up: Tile = field(default_factory=Tile)
    down: Tile = field(default_factory=Tile)

    def __post_init__(self) -> None:
        if self.block_m not in BLOCK_MS:
            raise ValueError(f"block_m={self.block_m}: one of {BLOCK_MS}")


#: ``(most assignments per expert, config)`` in increasing order of the bound:
#: :func:`pick_config` takes the first row whose bound is at least the routing's mean load
#: ``T·k / E`` (measured per (shape, T) by ``benchmarks/moe.py --grouped-sweep``).
#: One H200, 2026-12-03: at T = 16, 64 and 256 (about 1, 4 and 16 per expert on both the
#: Qwen1.5-MoE-A2.7B and Qwen3-30B-A3B shapes) the best of 54 configs, or within 1% of it
#: on both shapes (docs/benchmarks.md, MoE).
CONFIGS: tuple[tuple[float, GroupedConfig], ...] = (
    (2.0, GroupedConfig(16, Tile(32, 256, 4, 3), Tile(64, 128, 4, 3))),
    (8.0, GroupedConfig(16, Tile(32, 128, 4, 3), Tile(64, 128, 4, 3))),
    (math.inf, GroupedConfig(32, Tile(64, 128, 4, 3), Tile(64, 128, 4, 3))),
)
#: Tiles ``(block_n, block_k, num_warps, num_stages)`` the sweep times for each kernel at
#: each of ``BLOCK_MS``.
TILE_CANDIDATES: tuple[Tile, ...] = (
    Tile(64, 64, 4, 3), Tile(64, 64, 4, 5), Tile(32, 64, 4, 4), Tile(32, 128, 4, 3),
    Tile(32, 256, 4, 3), Tile(64, 128, 4, 3), Tile(64, 128, 8, 4), Tile(128, 64, 4, 3),
    Tile(128, 64, 8, 4),
)


def pick_config(num_assignments: int, num_experts: int, inter_size: int, hidden: int,
                ) -> GroupedConfig:
    """The ``CONFIGS`` row for ``num_assignments`` (``T·k``) over ``num_experts``, its tiles
    fitted to the shapes (gate/up: strips of ``inter_size``, chunks of ``hidden``; down the
    other way round)."""
    load = num_assignments / num_experts
    config = next(c for bound, c in CONFIGS if load <= bound)
    return replace(config, gate_up=config.gate_up.fit(inter_size, hidden),
                   down=config.down.fit(hidden, inter_size))


@triton.jit
def _tile(slot_rows_ptr, tile_expert_ptr, num_assign, BLOCK_M: tl.constexpr,
          BLOCK_N: tl.constexpr):
    """This program's tile: its expert (-1: empty), slots, their assignments (``valid``
    where a slot holds one) and its strip of output columns."""
    e = tl.load(tile_expert_ptr + tl.program_id(0))
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(slot_rows_ptr + offs_m)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return e, offs_m, rows, rows < num_assign, offs_n


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, s_ptr, slot_rows_ptr, tile_expert_ptr, inter_ptr, num_assign,
                    H: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    HAS_SCALE: tl.constexpr):
    """``inter[slot] = silu(x_t @ gate_e^T) * (x_t @ up_e^T)`` for one tile's slots and a
    ``BLOCK_N`` strip of the expert's ``I`` columns (``w`` is ``[E, 2I, H]``; FP8 with
    ``HAS_SCALE``: converted to the input's dtype for the dot, its rows' scales ``s``
    ``[E, 2I]`` applied to the sums)."""
    e, offs_m, rows, valid, offs_n = _tile(slot_rows_ptr, tile_expert_ptr, num_assign,
                                           BLOCK_M, BLOCK_N)
    if e < 0:
        return
    tokens = tl.where(valid, rows // TOP_K, 0)
    n_mask = offs_n < INTER
    w_base = w_ptr + e.to(tl.int64) * (2 * INTER * H)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < H
        a = tl.load(x_ptr + tokens[:, None].to(tl.int64) * H + offs_k[None, :],
                    mask=valid[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        wg = tl.load(w_base + offs_n[None, :] * H + offs_k[:, None], mask=w_mask, other=0.0)
        wu = tl.load(w_base + (offs_n[None, :] + INTER) * H + offs_k[:, None], mask=w_mask,
                     other=0.0)
        acc_g += dot(a, wg.to(a.dtype))
        acc_u += dot(a, wu.to(a.dtype))
    if HAS_SCALE:
        s_base = s_ptr + e.to(tl.int64) * (2 * INTER)
        acc_g *= tl.load(s_base + offs_n, mask=n_mask, other=0.0)[None, :]
        acc_u *= tl.load(s_base + INTER + offs_n, mask=n_mask, other=0.0)[None, :]
    dt = inter_ptr.dtype.element_ty
    g = acc_g.to(dt).to(tl.float32)
    u = acc_u.to(dt).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(inter_ptr + offs_m[:, None].to(tl.int64) * INTER + offs_n[None, :],
             (silu * u).to(dt), mask=n_mask[None, :])


@triton.jit
def _down_kernel(inter_ptr, w_ptr, s_ptr, slot_rows_ptr, tile_expert_ptr, weights_ptr, out_ptr,
                 num_assign, H: tl.constexpr, INTER: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_SCALE: tl.constexpr):
    """``out[assignment] = weight · (inter[slot] @ down_e^T)`` for one tile and a ``BLOCK_N``
    strip of the ``H`` outputs (``w`` is ``[E, H, I]``; FP8 with ``HAS_SCALE``, its rows'
    scales ``s`` ``[E, H]``)."""
    e, offs_m, rows, valid, offs_n = _tile(slot_rows_ptr, tile_expert_ptr, num_assign,
                                           BLOCK_M, BLOCK_N)
    if e < 0:
        return
    n_mask = offs_n < H
    w_base = w_ptr + e.to(tl.int64) * (H * INTER)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < INTER
        a = tl.load(inter_ptr + offs_m[:, None].to(tl.int64) * INTER + offs_k[None, :],
                    mask=k_mask[None, :], other=0.0)
        w = tl.load(w_base + offs_n[None, :] * INTER + offs_k[:, None],
                    mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc += dot(a, w.to(a.dtype))
    if HAS_SCALE:
        acc *= tl.load(s_ptr + e.to(tl.int64) * H + offs_n, mask=n_mask, other=0.0)[None, :]
    dt = out_ptr.dtype.element_ty
    weight = tl.load(weights_ptr + rows, mask=valid, other=0.0).to(tl.float32)
    y = acc.to(dt).to(tl.float32) * weight[:, None]
    safe_rows = tl.where(valid, rows, 0).to(tl.int64)
    tl.store(out_ptr + safe_rows[:, None] * H + offs_n[None, :], y.to(dt),
             mask=valid[:, None] & n_mask[None, :])


def grouped_gate_up(x: torch.Tensor, w_gate_up: torch.Tensor, slot_rows: torch.Tensor,
                    tile_expert: torch.Tensor, top_k: int, block_m: int, tile: Tile,
                    scale: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` of each slot's token through its tile's expert (``[tiles ·
    block_m, I]``; an empty slot's row is unspecified), from :func:`align`'s grouping."""
    t, h = x.shape
    tiles = tile_expert.shape[0]
    inter_size = w_gate_up.shape[1] // 2
    inter = torch.empty(tiles * block_m, inter_size, dtype=x.dtype, device=x.device)
    if tiles:
        _gate_up_kernel[(tiles, triton.cdiv(inter_size, tile.block_n))](
            x.contiguous(), w_gate_up.contiguous(), _scale_arg(scale, w_gate_up), slot_rows,
            tile_expert, inter, t * top_k, H=h, INTER=inter_size, TOP_K=top_k,
            BLOCK_M=block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
            HAS_SCALE=scale is not None, num_warps=tile.num_warps, num_stages=tile.num_stages)
    return inter


def grouped_down(inter: torch.Tensor, w_down: torch.Tensor, slot_rows: torch.Tensor,
                 tile_expert: torch.Tensor, topk_weights: torch.Tensor, block_m: int,
                 tile: Tile, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``weight · (inter[slot] @ down_e^T)`` for every assignment (``[T·k, H]``, row
    ``t·k + j``), from :func:`grouped_gate_up`'s rows."""
    h, inter_size = w_down.shape[1:]
    num_assign = topk_weights.numel()
    out = torch.empty(num_assign, h, dtype=inter.dtype, device=inter.device)
    tiles = tile_expert.shape[0]
    if tiles:
        _down_kernel[(tiles, triton.cdiv(h, tile.block_n))](
            inter, w_down.contiguous(), _scale_arg(scale, w_down), slot_rows, tile_expert,
            topk_weights.to(inter.dtype).contiguous().flatten(), out, num_assign, H=h,
            INTER=inter_size, BLOCK_M=block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
            HAS_SCALE=scale is not None, num_warps=tile.num_warps, num_stages=tile.num_stages)
    return out


def fused_moe(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              gate_up_scale: torch.Tensor | None = None, down_scale: torch.Tensor | None = None,
              config: GroupedConfig | None = None) -> torch.Tensor:
    """``ref.fused_moe`` through the grouped kernels (same arguments and result; FP8
    experts with their scales too); ``config``: :func:`pick_config`'s when None."""
    t, h = x.shape
    num_experts, two_i, _ = w_gate_up.shape
    top_k = topk_ids.shape[1]
    if t * top_k == 0:  # no rows
        return torch.zeros_like(x)
    config = config or pick_config(t * top_k, num_experts, two_i // 2, h)
    slot_rows, tile_expert = align(topk_ids, num_experts, config.block_m)
    inter = grouped_gate_up(x, w_gate_up, slot_rows, tile_expert, top_k, config.block_m,
                            config.gate_up, gate_up_scale)
    per_assignment = grouped_down(inter, w_down, slot_rows, tile_expert, topk_weights,
                                  config.block_m, config.down, down_scale)
    return per_assignment.view(t, top_k, h).sum(dim=1)


def _scale_arg(scale: torch.Tensor | None, weight: torch.Tensor) -> torch.Tensor:
    """The scale pointer a kernel gets: FP8 experts' ``[E, N]`` float32 scales, or (unused
    without ``HAS_SCALE``) the weight itself."""
    return weight if scale is None else scale.contiguous()
