"""MoE expert GEMVs for decode-size batches (routing and the shared expert's gated add:
``kernels.moe_route``).

At a few tokens the routed experts are a weight stream: batch 1 of Qwen1.5-MoE-A2.7B reads
4 of 60 experts (69 MB a layer) and multiplies each weight once. The grouped path
(``kernels.moe``) spends a dozen small torch ops per layer grouping the assignments by
expert and then runs few, large tiles; here nothing is grouped. Every kernel's launch shape
depends only on ``T`` and the model's shapes, and each program reads its expert id from
``topk_ids`` on the device, so a capture at a tier serves any routing, with no host sync.

* :func:`gemv_moe` — the routed experts (``ref.fused_moe``) in two launches:
  ``_gate_up_kernel`` over (assignment ``t·k + j``, strip of ``BLOCK_N`` intermediate
  columns) streams that expert's gate and up rows and stores ``silu(gate) * up``;
  ``_down_kernel`` over (token, strip of ``BLOCK_N`` hidden columns) holds the strips of
  all the token's ``k`` experts in one tile, scales each down projection by its routing
  weight and sums them in registers. No atomics and no extra pass over the ``k`` rows, so
  results are deterministic: a replay and its eager re-run agree bit for bit. With PDL the
  down kernel starts loading its weight strips while the gate/up kernel still runs (the
  gate/up kernel releases it only after waiting for the routing, so the expert ids are
  final). The fastest-varying grid axis runs over assignments (tokens), so programs that
  share an expert's strip run together and the repeats come from L2.

Rounding follows the references: projections accumulate in fp32 and round to the model
dtype, as ``linear`` does, and so do the SiLU, the product and the weighted terms. The sum
over a token's experts runs in fp32 and rounds once (the reference rounds after each
expert, in expert order), so results agree with the references to rounding, not bit for
bit.

Tiles ``(BLOCK_N, BLOCK_K, num_warps)`` come from :func:`pick_config`, a rule on the
shapes (long chunks, strips narrow enough for several programs per SM, bounded partial
sums); ``benchmarks/moe.py`` times the ``CANDIDATES`` against it.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from replaylm.kernels import pdl
from replaylm.kernels.pdl import wait_for_previous

#: Tiles ``(BLOCK_N, BLOCK_K, num_warps)`` of the expert GEMVs that benchmarks/moe.py times
#: against :func:`pick_config`'s choice (``candidates`` keeps those within ``MAX_TILE``).
CANDIDATES: list[tuple[int, int, int]] = [
    (2, 512, 4), (2, 512, 8), (4, 512, 4), (4, 256, 4), (4, 256, 8), (8, 512, 4),
    (8, 512, 8), (8, 256, 4), (8, 256, 8), (16, 256, 8), (16, 128, 4), (32, 128, 8),
]
#: Most (token, expert) assignments ``kernels.ops.fused_moe`` sends to :func:`gemv_moe`;
#: above, the grouped path (``kernels.moe``). The GEMVs read an expert once per assignment
#: (repeats from L2 at best) while grouping reads it once per tile but costs a dozen small
#: launches. benchmarks/moe.py on the H200 had the GEMVs faster at T=4 on both named MoE
#: shapes (16 and 32 assignments) and the grouped kernels faster at T=16 (64 and 128;
#: docs/benchmarks.md, MoE).
MAX_ASSIGNMENTS = 32
#: Programs per SM :func:`pick_config` aims for: enough weight loads in flight to keep
#: HBM busy while each program waits on its own.
PROGRAMS_PER_SM = 4
#: Most fp32 partial sums per program (``BLOCK_N × BLOCK_K`` per weight strip): with 8
#: warps, 32 registers a lane, so several programs fit on an SM beside their loads.
MAX_TILE = 8192
#: Chunks of the down strips up to which a program loads them whole before its PDL wait
#: (``_down_kernel`` spells out four).
MAX_UNROLL = 4


def candidates(operands: int, k: int) -> list[tuple[int, int, int]]:
    """The ``CANDIDATES`` a kernel streaming ``operands`` strips (gate/up: 2; down: ``k``
    experts' to the next power of two) over reduction length ``k`` can use: at most
    ``MAX_TILE`` partial sums, chunks no longer than ``k`` needs."""
    longest = triton.next_power_of_2(k)
    return [(bn, bk, w) for bn, bk, w in CANDIDATES
            if operands * bn * bk <= MAX_TILE and bk <= longest]


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def pick_config(rows: int, n: int, k: int, device: torch.device | None = None,
                operands: int = 1) -> tuple[int, int, int]:
    """``(BLOCK_N, BLOCK_K, num_warps)`` for a GEMV of ``rows`` independent rows (grid
    ``rows × cdiv(n, BLOCK_N)``) over reduction length ``k``, each program streaming
    ``operands`` weight strips (gate and up: 2; down: one per expert slot). The strip is
    the widest whose grid reaches ``PROGRAMS_PER_SM`` programs per SM, among those that
    leave chunks of at least 256 (512 bytes a row) within ``MAX_TILE`` partial sums; the
    chunk is as long as 512 (16-byte loads per lane; a masked tail where it does not
    divide ``k``) and the tile allow; 8 warps above 4,096 partial sums (32 registers a lane
    either way)."""
    if device is None or device.type != "cuda":
        sms = 132  # no GPU (the interpreter): an H100/H200's count, for the same tiles
    else:
        sms = _sm_count(device.index if device.index is not None
                        else torch.cuda.current_device())
    shortest = min(256, triton.next_power_of_2(k))
    widths = [bn for bn in (32, 16, 8, 4, 2) if operands * bn * shortest <= MAX_TILE] or [2]
    block_n = next((bn for bn in widths if rows * triton.cdiv(n, bn) >= PROGRAMS_PER_SM * sms),
                   widths[-1])
    block_k = min(512, triton.next_power_of_2(k), MAX_TILE // (operands * block_n))
    return block_n, block_k, 4 if operands * block_n * block_k <= 4096 else 8


@triton.jit
def _wait_then_release(USE_PDL: tl.constexpr):
    """The PDL wait, then let the next kernel be scheduled (``pdl.wait_for_previous`` in the
    other order): once the next kernel runs, every program of this one has seen its
    predecessor finish, so the next may read what that predecessor wrote before its own
    wait (``_down_kernel`` reads the expert ids early)."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def _strip_dot(acc, w_ptrs, x_ptrs, n_mask, cols, K: tl.constexpr, BLOCK_K: tl.constexpr,
               EVEN_N: tl.constexpr):
    """``acc`` ``[BLOCK_N, BLOCK_K]`` plus the elementwise products of a weight strip
    (``w_ptrs``: its rows at the first chunk) and one input row, over all of ``K``. The
    chunk loop is unrolled so that the compiler can issue several chunks' loads before the
    first is used; only a partial last chunk (or strip) is masked. The one cross-lane
    reduction is left to the caller."""
    for k0 in tl.static_range(0, K, BLOCK_K):
        if EVEN_N and k0 + BLOCK_K <= K:
            w = tl.load(w_ptrs + k0, eviction_policy="evict_first")
            x = tl.load(x_ptrs + k0)
        else:
            k_mask = (k0 + cols) < K
            w = tl.load(w_ptrs + k0, mask=n_mask[:, None] & k_mask[None, :], other=0.0,
                        eviction_policy="evict_first")
            x = tl.load(x_ptrs + k0, mask=k_mask, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    return acc


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, s_ptr, ids_ptr, inter_ptr, H: tl.constexpr,
                    INTER: tl.constexpr, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr, HAS_SCALE: tl.constexpr,
                    USE_PDL: tl.constexpr):
    """``inter[a] = silu(x_t @ gate_e^T) * (x_t @ up_e^T)`` for assignment ``a = t·k + j``
    and one ``BLOCK_N`` strip of its expert's ``I`` columns (``w`` is ``[E, 2I, H]``; FP8
    with ``HAS_SCALE``, its rows' scales ``s`` ``[E, 2I]`` applied to the sums)."""
    a = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    n_mask = offs_n < INTER
    _wait_then_release(USE_PDL)  # the expert id is the previous kernel's output
    e = tl.load(ids_ptr + a).to(tl.int64)
    x_ptrs = x_ptr + (a // TOP_K) * H + cols
    gate_ptrs = w_ptr + e * (2 * INTER * H) + offs_n[:, None].to(tl.int64) * H + cols[None, :]
    acc_g = _strip_dot(tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32), gate_ptrs, x_ptrs,
                       n_mask, cols, H, BLOCK_K, EVEN_N)
    acc_u = _strip_dot(tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32), gate_ptrs + INTER * H,
                       x_ptrs, n_mask, cols, H, BLOCK_K, EVEN_N)
    dt = inter_ptr.dtype.element_ty
    g = tl.sum(acc_g, axis=1)
    u = tl.sum(acc_u, axis=1)
    if HAS_SCALE:
        s_base = s_ptr + e * (2 * INTER)
        g = g * tl.load(s_base + offs_n, mask=n_mask, other=0.0)
        u = u * tl.load(s_base + INTER + offs_n, mask=n_mask, other=0.0)
    g = g.to(dt).to(tl.float32)
    u = u.to(dt).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(inter_ptr + a * INTER + offs_n, (silu * u).to(dt), mask=n_mask)


@triton.jit
def _down_chunk(w_base, e_off, offs_n, rows_ok, cols, k0, INTER: tl.constexpr,
                BLOCK_K: tl.constexpr, EVEN_ROWS: tl.constexpr):
    """Chunk ``k0`` of the down strips: ``[SLOTS·BLOCK_N, BLOCK_K]``, row ``j·BLOCK_N + n``
    from expert ``e_j``'s row ``offs_n[n]``."""
    ptrs = w_base + e_off[:, None] + offs_n[:, None].to(tl.int64) * INTER + (k0 + cols)[None, :]
    if EVEN_ROWS and k0 + BLOCK_K <= INTER:
        return tl.load(ptrs, eviction_policy="evict_first")
    return tl.load(ptrs, mask=rows_ok[:, None] & ((k0 + cols) < INTER)[None, :], other=0.0,
                   eviction_policy="evict_first")


@triton.jit
def _down_fma(acc, w, x_rows, cols, k0, INTER: tl.constexpr, BLOCK_K: tl.constexpr):
    if k0 + BLOCK_K <= INTER:
        x = tl.load(x_rows[:, None] + (k0 + cols)[None, :])
    else:
        x = tl.load(x_rows[:, None] + (k0 + cols)[None, :],
                    mask=((k0 + cols) < INTER)[None, :], other=0.0)
    return acc + w.to(tl.float32) * x.to(tl.float32)


@triton.jit
def _down_kernel(inter_ptr, w_ptr, s_ptr, ids_ptr, weights_ptr, out_ptr, H: tl.constexpr,
                 INTER: tl.constexpr, TOP_K: tl.constexpr, SLOTS: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_ROWS: tl.constexpr,
                 CHUNKS: tl.constexpr, WHOLE: tl.constexpr, HAS_SCALE: tl.constexpr,
                 USE_PDL: tl.constexpr):
    """``out[t] = sum_j weight[t, j] · (inter[t·k + j] @ down_e^T)`` over the token's ``k``
    experts, for one ``BLOCK_N`` strip of the ``H`` outputs (``w`` is ``[E, H, I]``): one
    ``[SLOTS·BLOCK_N, BLOCK_K]`` tile holds the strip of every expert (``SLOTS``: ``k`` to
    the next power of two, the extra rows masked), so the ``k`` terms are summed in
    registers.

    The expert ids were written two kernels back, and ``_gate_up_kernel`` lets this kernel
    be scheduled only after every one of its programs has waited for them, so they may be
    read before this kernel's own PDL wait; a strip of up to ``MAX_UNROLL`` chunks
    (``WHOLE``) is loaded then too, and streams while the gate/up kernel finishes."""
    t = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, SLOTS * BLOCK_N)
    slot = rows // BLOCK_N
    offs_n = tl.program_id(1) * BLOCK_N + rows % BLOCK_N
    real = slot < TOP_K
    rows_ok = real & (offs_n < H)
    cols = tl.arange(0, BLOCK_K)
    a = t * TOP_K + slot
    e = tl.load(ids_ptr + a, mask=real, other=0).to(tl.int64)
    e_off = e * (H * INTER)
    w0 = _down_chunk(w_ptr, e_off, offs_n, rows_ok, cols, 0, INTER, BLOCK_K, EVEN_ROWS)
    w1 = w0  # placeholders; chunks past the strip's end are never used
    w2 = w0
    w3 = w0
    if WHOLE and CHUNKS > 1:
        w1 = _down_chunk(w_ptr, e_off, offs_n, rows_ok, cols, BLOCK_K, INTER, BLOCK_K,
                         EVEN_ROWS)
    if WHOLE and CHUNKS > 2:
        w2 = _down_chunk(w_ptr, e_off, offs_n, rows_ok, cols, 2 * BLOCK_K, INTER, BLOCK_K,
                         EVEN_ROWS)
    if WHOLE and CHUNKS > 3:
        w3 = _down_chunk(w_ptr, e_off, offs_n, rows_ok, cols, 3 * BLOCK_K, INTER, BLOCK_K,
                         EVEN_ROWS)
    wait_for_previous(USE_PDL)
    # Padded slots (their weights are masked to 0) read the token's first row, in bounds.
    x_rows = inter_ptr + tl.where(real, a, t * TOP_K) * INTER
    acc = _down_fma(tl.zeros((SLOTS * BLOCK_N, BLOCK_K), dtype=tl.float32), w0, x_rows, cols,
                    0, INTER, BLOCK_K)
    if WHOLE:
        if CHUNKS > 1:
            acc = _down_fma(acc, w1, x_rows, cols, BLOCK_K, INTER, BLOCK_K)
        if CHUNKS > 2:
            acc = _down_fma(acc, w2, x_rows, cols, 2 * BLOCK_K, INTER, BLOCK_K)
        if CHUNKS > 3:
            acc = _down_fma(acc, w3, x_rows, cols, 3 * BLOCK_K, INTER, BLOCK_K)
    else:
        for k0 in tl.static_range(BLOCK_K, INTER, BLOCK_K):
            w = _down_chunk(w_ptr, e_off, offs_n, rows_ok, cols, k0, INTER, BLOCK_K,
                            EVEN_ROWS)
            acc = _down_fma(acc, w, x_rows, cols, k0, INTER, BLOCK_K)
    dt = out_ptr.dtype.element_ty
    weight = tl.load(weights_ptr + a, mask=real, other=0.0).to(tl.float32)
    y = tl.sum(acc, axis=1)
    if HAS_SCALE:  # FP8 experts: each row's scale (``s`` is ``[E, H]``)
        y = y * tl.load(s_ptr + e * H + offs_n, mask=rows_ok, other=0.0)
    y = (y.to(dt).to(tl.float32) * weight).to(dt).to(tl.float32)
    y = tl.where(real, y, 0.0)
    total = tl.sum(tl.reshape(y, (SLOTS, BLOCK_N)), axis=0)
    offs_out = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(out_ptr + t * H + offs_out, total.to(dt), mask=offs_out < H)


def gate_up_gemv(x: torch.Tensor, w_gate_up: torch.Tensor, topk_ids: torch.Tensor,
                 config: tuple[int, int, int] | None = None,
                 scale: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(x_t @ gate_e^T) * (x_t @ up_e^T)`` for every assignment (``[T·k, I]``, row
    ``t·k + j`` for ``e = topk_ids[t, j]``); ``config``: ``(BLOCK_N, BLOCK_K, num_warps)``,
    :func:`pick_config` when None; ``scale``: FP8 experts' per-row scales ``[E, 2I]``."""
    t, h = x.shape
    inter_size, top_k = w_gate_up.shape[1] // 2, topk_ids.shape[1]
    inter = torch.empty(t * top_k, inter_size, dtype=x.dtype, device=x.device)
    if t == 0:
        return inter
    bn, bk, warps = config or pick_config(t * top_k, inter_size, h, x.device, operands=2)
    _gate_up_kernel[(t * top_k, triton.cdiv(inter_size, bn))](
        x.contiguous(), w_gate_up, w_gate_up if scale is None else scale.contiguous(),
        topk_ids.contiguous(), inter, H=h, INTER=inter_size, TOP_K=top_k, BLOCK_N=bn,
        BLOCK_K=bk, EVEN_N=inter_size % bn == 0, HAS_SCALE=scale is not None,
        USE_PDL=pdl.ENABLED, num_warps=warps, **pdl.LAUNCH)
    return inter


def down_gemv(inter: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, config: tuple[int, int, int] | None = None,
              scale: torch.Tensor | None = None) -> torch.Tensor:
    """``out[t] = sum_j weight[t, j] · (inter[t·k + j] @ down_e^T)`` (``[T, H]``);
    ``config`` as in :func:`gate_up_gemv` (``BLOCK_N`` rows per expert; the tile has ``k``
    times as many), :func:`pick_config` when None; ``scale``: FP8 experts' per-row scales
    ``[E, H]``.

    With PDL the kernel reads ``topk_ids`` before waiting for the kernel launched before it:
    no kernel that may still be running may write them (true after :func:`gate_up_gemv`,
    which releases its successor only once it has waited for its own predecessor)."""
    t, top_k = topk_ids.shape
    h, inter_size = w_down.shape[1:]
    out = torch.empty(t, h, dtype=inter.dtype, device=inter.device)
    if t == 0:
        return out
    slots = triton.next_power_of_2(top_k)
    bn, bk, warps = config or pick_config(t, h, inter_size, inter.device, operands=slots)
    chunks = triton.cdiv(inter_size, bk)
    _down_kernel[(t, triton.cdiv(h, bn))](
        inter, w_down, w_down if scale is None else scale.contiguous(), topk_ids.contiguous(),
        topk_weights.contiguous(), out, H=h, INTER=inter_size, TOP_K=top_k, SLOTS=slots,
        BLOCK_N=bn, BLOCK_K=bk, EVEN_ROWS=h % bn == 0 and slots == top_k, CHUNKS=chunks,
        WHOLE=chunks <= MAX_UNROLL, HAS_SCALE=scale is not None, USE_PDL=pdl.ENABLED,
        num_warps=warps, **pdl.LAUNCH)
    return out


def gemv_moe(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
             topk_weights: torch.Tensor, topk_ids: torch.Tensor,
             gate_up_scale: torch.Tensor | None = None, down_scale: torch.Tensor | None = None,
             gate_up_config: tuple[int, int, int] | None = None,
             down_config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """``ref.fused_moe`` (same arguments and result, FP8 experts with their scales too) by
    per-assignment GEMVs: two launches, no grouping."""
    inter = gate_up_gemv(x, w_gate_up.contiguous(), topk_ids, gate_up_config, gate_up_scale)
    return down_gemv(inter, w_down.contiguous(), topk_weights, topk_ids, down_config,
                     down_scale)
