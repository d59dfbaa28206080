"""Grouped routed experts for MoE layers: the Triton path of ``fused_moe``.

Graph safe: no host sync and no data-dependent shape. The ``T × top_k`` (token, expert)
assignments are grouped by expert on the device (:func:`align`): each expert's assignments
fill whole tiles of ``BLOCK_M`` slots, and the number of tiles is the host-known bound
``T·k // BLOCK_M + min(E, T·k)``, so a capture at a tier serves any routing. Tiles past
the last expert's are marked empty and their programs return at once. Each tile then runs
one expert's grouped GEMMs: gate/up with SiLU·mul (``_gate_up_kernel``) into an
intermediate buffer, and down scaled by the routing weight (``_down_kernel``) into one row
per assignment; the ``k`` rows of a token are summed last. A tile reads only its expert's
weights, so a batch-1 decode step reads the ``k`` chosen experts and no other.

Rounding follows ``ref.fused_moe`` (projections accumulate in fp32 and round to the model
dtype, as ``linear`` does); the sum over a token's experts runs in top-k order, not expert
order, so results agree with the reference to rounding, not bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replaylm.kernels.dot import dot

BLOCK_M = 16  # slots per tile (tl.dot needs at least 16)


def max_tiles(num_assignments: int, num_experts: int, block_m: int = BLOCK_M) -> int:
    """Tiles any routing of ``num_assignments`` over ``num_experts`` can fill: the sum over
    used experts of ``ceil(count / block_m)`` is at most ``A // block_m + min(E, A)``."""
    return num_assignments // block_m + min(num_experts, num_assignments)


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M,
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Group the assignments ``topk_ids`` ``[T, k]`` by expert in tiles of ``block_m``.

    Returns ``slot_rows`` ``[tiles · block_m]`` (int32: the flat assignment ``t·k + j`` in
    each slot, ``T·k`` for an empty one) and ``tile_expert`` ``[tiles]`` (int32: the
    tile's expert, -1 past the last used tile), ``tiles`` = :func:`max_tiles`.
    """
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


def fused_moe(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              gate_up_scale: torch.Tensor | None = None, down_scale: torch.Tensor | None = None,
              block_n: int = 64, block_k: int = 64) -> torch.Tensor:
    """``ref.fused_moe`` through the grouped kernels (same arguments and result; FP8
    experts with their scales too)."""
    t, h = x.shape
    num_experts, two_i, _ = w_gate_up.shape
    inter_size, top_k = two_i // 2, topk_ids.shape[1]
    slot_rows, tile_expert = align(topk_ids, num_experts)
    tiles = tile_expert.shape[0]
    x = x.contiguous()
    inter = torch.empty(tiles * BLOCK_M, inter_size, dtype=x.dtype, device=x.device)
    per_assignment = torch.empty(t * top_k, h, dtype=x.dtype, device=x.device)
    if tiles == 0:  # no rows
        return torch.zeros_like(x)
    _gate_up_kernel[(tiles, triton.cdiv(inter_size, block_n))](
        x, w_gate_up.contiguous(), _scale_arg(gate_up_scale, w_gate_up), slot_rows,
        tile_expert, inter, t * top_k, H=h, INTER=inter_size, TOP_K=top_k, BLOCK_M=BLOCK_M,
        BLOCK_N=block_n, BLOCK_K=block_k, HAS_SCALE=gate_up_scale is not None)
    _down_kernel[(tiles, triton.cdiv(h, block_n))](
        inter, w_down.contiguous(), _scale_arg(down_scale, w_down), slot_rows, tile_expert,
        topk_weights.to(x.dtype).contiguous().flatten(), per_assignment, t * top_k, H=h,
        INTER=inter_size, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
        HAS_SCALE=down_scale is not None)
    return per_assignment.view(t, top_k, h).sum(dim=1)


def _scale_arg(scale: torch.Tensor | None, weight: torch.Tensor) -> torch.Tensor:
    """The scale pointer a kernel gets: FP8 experts' ``[E, N]`` float32 scales, or (unused
    without ``HAS_SCALE``) the weight itself."""
    return weight if scale is None else scale.contiguous()
