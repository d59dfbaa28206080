"""The skinny projection with its LoRA adapters in one launch at a few rows: the shrink's
programs (``kernels.lora``'s) first, then ``kernels.skinny``'s strips with the delta in their
epilogue.

Programs ``0 .. T*S*splits - 1`` are the shrink: program (row, segment, K range) computes
its range's fp32 partial sums of ``u[t] @ A[slot]^T`` (``u`` the prologue's rows: RMSNorm
of ``x + residual``, or ``x`` as it is) exactly as ``lora.lora_shrink`` does, stores them,
and adds 1 to each of the group's counter replicas (release). The programs after them are
the projection's strips (plain or with the RMSNorm prologue; same tiles and PDL as
``_skinny_kernel``): each streams its weight strip, and a strip with a live row then waits
for its replica (``REPLICAS``, so that the waiting strips do not all poll one address) to
count every shrink program (acquire), adds each segment's partial sums in range order,
rounds the shrink to the model dtype (as ``lora.lora_expand`` does) and adds
``scale[slot] * s @ B[slot]^T`` to its fp32 sums before the one rounding to the model
dtype; the delta itself is not rounded (``lora_expand`` adds a rounded delta to the rounded
projection). The reference is ``ref.lora_linear``. Each projection of a forward has its
own counter, which the forward zeroes first (``LlamaModel.first_link``), so the strips
write nothing to it. The waits cannot deadlock: the shrink programs have the lowest
indices, so they are on the SMs before any strip that waits for them.

A row whose slot is -1 (a base-model row, padding) or empty (rank 0) costs its slot index
and nothing more: its shrink programs store nothing, a tile without a live row waits for
none of them, and a tile's dead rows are stored as the plain kernel computes them. Slot,
rank and scale are read on the device, so one captured graph serves every mix of adapters.

It shares ``_skinny_kernel``'s strip loads, main loop and epilogues (``skinny._load_strip``,
``_strip_sums``, ``_epilogue``, the paired SiLU·mul store), runs whole-K tiles only (a
split-K tile's reduction pass would need the delta instead) and takes the tile the tuner
chose for the base projection. ``kernels.ops`` decides when to fold: where the projection
(with the norm prologue, or plain: o, down, and qkv or gate_up after a separate norm) runs
a whole-K skinny tile; otherwise the op launches ``lora_shrink``, the projection as without
LoRA and ``lora_expand``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replaylm.env import triton_interpreted
from replaylm.kernels import skinny
from replaylm.kernels.lora import (
    _shrink_range,
    _shrink_tile,
    check_input,
    segment_bounds,
    shrink_split,
)
from replaylm.kernels.pdl import wait_for_previous
from replaylm.kernels.ref import LORA_COUNTER_INTS, LoRAGroup
from replaylm.kernels.skinny import _load_strip, _strip_sums
from replaylm.kernels.skinny_epilogue import _epilogue, _store_silu_pairs


@triton.jit
def _lora_weights(lb_ptr, slots_ptr, ranks_ptr, scales_ptr, offs_m, m_mask, offs_n, n_mask,
                  stride_lbl, stride_lbn, BLOCK_R: tl.constexpr):
    """What the delta reads that no kernel of the step writes, so it is read before the PDL
    wait: each row's slot (copied in before the step's first kernel), the slot's rank and
    scale and the strip's ``B`` rows (written between steps only). Returns ``(b, rank,
    scale)``: ``b`` ``[BLOCK_M, BLOCK_N, BLOCK_R]`` in ``B``'s dtype, 0 past a row's rank;
    a dead row (slot -1 or rank 0) has rank 0 and reads no ``B``."""
    slot = tl.load(slots_ptr + offs_m, mask=m_mask, other=-1)
    row_slot = tl.maximum(slot, 0).to(tl.int64)
    rank = tl.load(ranks_ptr + row_slot, mask=slot >= 0, other=0)
    scale = tl.load(scales_ptr + row_slot, mask=slot >= 0, other=0.0)
    r = tl.arange(0, BLOCK_R)
    r_ok = r[None, :] < rank[:, None]  # [BM, BR]: none on a dead row
    b = tl.load(lb_ptr + row_slot[:, None, None] * stride_lbl + offs_n[None, :, None] * stride_lbn
                + r[None, None, :], mask=r_ok[:, None, :] & n_mask[None, :, None], other=0.0)
    return b, rank, scale


@triton.jit
def _await_shrinks(cnt_ptr, count, SPIN_NS: tl.constexpr):
    """Spin until the counter at ``cnt_ptr`` shows ``count`` shrink programs' releases: plain
    (volatile) reads, ``SPIN_NS`` apart (0: back to back), then one read with acquire, whose
    result (true) the caller's reads of their sums take as their mask, which orders them
    after the shrink programs' stores. (An acquire read per poll
    fences the SM's memory traffic each time: the first form of this kernel, polling that
    way, took 46-92 µs per projection at one live row on the H100.)"""
    done = tl.load(cnt_ptr, volatile=True)
    while done < count:
        if SPIN_NS > 0:
            done = tl.inline_asm_elementwise(f"nanosleep.u32 {SPIN_NS}; mov.u32 $0, $1;",
                                             "=r,r", [done], dtype=tl.int32, is_pure=False,
                                             pack=1)
        done = tl.load(cnt_ptr, volatile=True)
    return tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu") >= count  # always true


@triton.jit
def _lora_delta(y_ptr, lp_ptr, cnt_ptr, lead, b, rank, scale, offs_m, offs_n, n_lo, n_hi, seg1,
                seg2, stride_lpt, stride_lps, R: tl.constexpr, NUM_SEG: tl.constexpr,
                SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_R: tl.constexpr, SPIN_NS: tl.constexpr):
    """``scale * s @ B^T`` of each row of the tile over columns ``offs_n`` (fp32
    ``[BLOCK_M, BLOCK_N]``), from ``_lora_weights``'s ``b``, ``rank`` and ``scale`` and the
    shrink programs' partial sums (awaited, then read from L2: other SMs wrote them); and
    which rows are live. A tile without a live row waits for nothing."""
    live = rank > 0
    delta = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if tl.max(live.to(tl.int32), axis=0) > 0:
        ready = _await_shrinks(cnt_ptr, lead, SPIN_NS)
        dt = y_ptr.dtype.element_ty
        r = tl.arange(0, BLOCK_R)
        r_ok = (r[None, :] < rank[:, None]) & ready
        bf = b.to(tl.float32)
        seg = (offs_n >= seg1).to(tl.int32) + (offs_n >= seg2).to(tl.int32)
        seg_lo = (n_lo >= seg1).to(tl.int32) + (n_lo >= seg2).to(tl.int32)
        seg_hi = (n_hi >= seg1).to(tl.int32) + (n_hi >= seg2).to(tl.int32)
        for j in tl.static_range(NUM_SEG):
            if (seg_lo <= j) & (j <= seg_hi):  # the strip has columns of segment j
                # Its shrink: the ranges' partial sums in range order, rounded to the model
                # dtype as a separate LoRA branch stores it.
                s_ptrs = lp_ptr + offs_m[:, None] * stride_lpt + j * R + r[None, :]
                sj = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
                for sp in tl.static_range(SPLITS):
                    sj += tl.load(s_ptrs + sp * stride_lps, mask=r_ok, other=0.0,
                                  cache_modifier=".cg")
                sj = sj.to(dt).to(tl.float32)
                part = tl.sum(bf * sj[:, None, :], axis=2)
                delta += tl.where((seg == j)[None, :], part, 0.0)
        delta = delta * scale[:, None]
    return delta, live


@triton.jit
def _strip(pid, lead, x_ptr, r_ptr, nw_ptr, res_out_ptr, w_ptr, s_ptr, b_ptr, y_ptr,
           M, N, eps, stride_xm, stride_rm, stride_om, stride_wn, stride_ym, lp_ptr, lb_ptr,
           slots_ptr, ranks_ptr, scales_ptr, cnt_ptr, seg1, seg2, stride_lpt, stride_lps,
           stride_lbl, stride_lbn, K: tl.constexpr, PROLOGUE: tl.constexpr,
           HAS_RESIDUAL: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
           EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, CHUNKS: tl.constexpr,
           WHOLE: tl.constexpr, USE_PDL: tl.constexpr, SILU_PAIRS: tl.constexpr,
           R: tl.constexpr, NUM_SEG: tl.constexpr, SPLITS: tl.constexpr,
           BLOCK_R: tl.constexpr, SPIN_NS: tl.constexpr):
    """Strip ``pid`` of the projection (``skinny._skinny_kernel``'s program, whole-K), with
    the LoRA delta added to its fp32 sums before the store (with ``SILU_PAIRS``, before
    SiLU·mul of the paired gate and up rows). ``cnt_ptr``: the counter replica it reads."""
    if SILU_PAIRS:  # the strip of paired gate and up rows, as in ``_skinny_kernel``
        pair = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N) % (BLOCK_N // 2)
        offs_n = tl.where(tl.arange(0, BLOCK_N) < BLOCK_N // 2, pair, pair + N // 2)
        n_mask = pair < N // 2
        n_lo = pid * (BLOCK_N // 2)  # a gate row and an up row: both segments
        n_hi = N // 2 + n_lo
    else:
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        n_lo = pid * BLOCK_N
        n_hi = tl.minimum(n_lo + BLOCK_N, N) - 1
    offs_m = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    # The weight strip and the LoRA weights before the PDL wait, as in ``_skinny_kernel``.
    w_ptrs, w0, w1, w2, w3 = _load_strip(w_ptr, offs_n, n_mask, cols, 0, stride_wn, K, BLOCK_K,
                                         EVEN_N, EVEN_K, CHUNKS, WHOLE)
    b, rank, scale = _lora_weights(lb_ptr, slots_ptr, ranks_ptr, scales_ptr, offs_m, m_mask,
                                   offs_n, n_mask, stride_lbl, stride_lbn, BLOCK_R)
    wait_for_previous(USE_PDL)
    out, sq = _strip_sums(w_ptrs, w0, w1, w2, w3, n_mask, 0, K, x_ptr, r_ptr, nw_ptr,
                          res_out_ptr, offs_m, m_mask, cols, pid == 0, stride_xm, stride_rm,
                          stride_om, K, PROLOGUE, HAS_RESIDUAL, BLOCK_M, BLOCK_N, BLOCK_K,
                          EVEN_N, EVEN_K, CHUNKS, WHOLE)
    delta, live = _lora_delta(y_ptr, lp_ptr, cnt_ptr, lead, b, rank, scale, offs_m, offs_n,
                              n_lo, n_hi, seg1, seg2, stride_lpt, stride_lps, R, NUM_SEG,
                              SPLITS, BLOCK_M, BLOCK_N, BLOCK_R, SPIN_NS)
    out = _epilogue(out, sq, s_ptr, b_ptr, offs_n, n_mask, eps, K, PROLOGUE, HAS_SCALE, HAS_BIAS)
    out = tl.where(live[:, None], out + delta, out)  # a dead row: the plain kernel's sums
    if SILU_PAIRS:
        _store_silu_pairs(out, y_ptr, offs_m, m_mask, pid, N // 2, stride_ym, BLOCK_M, BLOCK_N)
    else:
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
                 out.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["seg1", "seg2"])
def _skinny_lora_kernel(x_ptr, r_ptr, nw_ptr, res_out_ptr, w_ptr, s_ptr, b_ptr, y_ptr, part_ptr,
                        M, N, eps, stride_xm, stride_rm, stride_om, stride_wn, stride_ym,
                        la_ptr, lp_ptr, lb_ptr, slots_ptr, ranks_ptr, scales_ptr, cnt_ptr,
                        seg1, seg2, stride_lal, stride_lar, stride_lpt, stride_lps, stride_lbl,
                        stride_lbn, K: tl.constexpr, PROLOGUE: tl.constexpr,
                        HAS_RESIDUAL: tl.constexpr, HAS_SCALE: tl.constexpr,
                        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
                        CHUNKS: tl.constexpr, WHOLE: tl.constexpr, SPLIT_K: tl.constexpr,
                        USE_PDL: tl.constexpr, SILU_PAIRS: tl.constexpr, R: tl.constexpr,
                        NUM_SEG: tl.constexpr, SPLITS: tl.constexpr, BLOCK_R: tl.constexpr,
                        RANGE_K: tl.constexpr, NORM_BLOCK: tl.constexpr,
                        REPLICAS: tl.constexpr, REPLICA_STRIDE: tl.constexpr,
                        SPIN_NS: tl.constexpr):
    """The shrink programs, then the projection's strips (``_strip``; whole-K tiles,
    ``SPLIT_K`` 1 and ``part_ptr`` unused). Program ``pid < M * NUM_SEG * SPLITS`` is
    ``lora._shrink_kernel``'s program (row, segment, K range): it stores its fp32 partial
    sums, then adds 1 to each of the counter's ``REPLICAS`` (release); strip ``j`` reads
    replica ``j % REPLICAS``."""
    pid = tl.program_id(0)
    lead = M * (NUM_SEG * SPLITS)
    if pid < lead:
        row = (pid // (NUM_SEG * SPLITS)).to(tl.int64)
        seg = (pid // SPLITS) % NUM_SEG
        split = pid % SPLITS
        av, rank = _shrink_tile(la_ptr, slots_ptr, ranks_ptr, row, seg, split, K, stride_lal,
                                stride_lar, R, BLOCK_R, RANGE_K)
        wait_for_previous(USE_PDL)
        _shrink_range(x_ptr, r_ptr, nw_ptr, lp_ptr, av, rank, row, seg, split, K, eps,
                      stride_xm, stride_rm, stride_lpt, stride_lps, R, PROLOGUE, HAS_RESIDUAL,
                      BLOCK_R, RANGE_K, NORM_BLOCK)
        tl.debug_barrier()  # every thread's sums are stored before the release
        tl.atomic_add(cnt_ptr + tl.arange(0, REPLICAS) * REPLICA_STRIDE, 1, sem="release",
                      scope="gpu")
    else:
        strip = pid - lead
        _strip(strip, lead, x_ptr, r_ptr, nw_ptr, res_out_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N,
               eps, stride_xm, stride_rm, stride_om, stride_wn, stride_ym, lp_ptr, lb_ptr,
               slots_ptr, ranks_ptr, scales_ptr, cnt_ptr + (strip % REPLICAS) * REPLICA_STRIDE,
               seg1, seg2, stride_lpt, stride_lps, stride_lbl, stride_lbn, K, PROLOGUE,
               HAS_RESIDUAL, HAS_SCALE, HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_N, EVEN_K,
               CHUNKS, WHOLE, USE_PDL, SILU_PAIRS, R, NUM_SEG, SPLITS, BLOCK_R, SPIN_NS)


def foldable(config: tuple[int, ...] | None) -> bool:
    """Whether the skinny tile ``config`` (a tuner decision; None: cuBLAS or the unfused
    ops) can carry the LoRA epilogue: a whole-K tile."""
    return config is not None and (len(config) == 4 or config[4] <= 1)


#: Copies of the counter that the shrink programs add to, each on its own 128-byte line:
#: the strips that wait spread their reads over them rather than all polling one address.
REPLICAS = 8
REPLICA_STRIDE = 32
assert REPLICAS * REPLICA_STRIDE <= LORA_COUNTER_INTS
#: Nanoseconds a waiting strip sleeps between reads of its counter (0: none; always 0 in the
#: Triton interpreter, which runs no inline PTX).
SPIN_NS = 100


def _lora_args(lora: LoRAGroup, rows: int, in_dim: int, out_dim: int,
               device: torch.device) -> tuple[dict, int]:
    """The LoRA kernel's arguments past ``_skinny_kernel``'s, and its shrink programs'
    count: one per (row, segment, K range) (``lora.shrink_split``)."""
    a, b = lora.a, lora.b
    rank, num_seg = b.shape[2], len(lora.segments)
    assert a.shape[1] == num_seg * rank and a.stride(2) == 1
    assert b.shape[1] == out_dim and b.stride(2) == 1
    range_k = shrink_split(in_dim, rank)
    splits = triton.cdiv(in_dim, range_k)
    lead = rows * num_seg * splits
    parts = torch.empty(rows, splits, num_seg * rank, dtype=torch.float32, device=device)
    counter = lora.counter
    if counter is None:
        counter = torch.zeros(LORA_COUNTER_INTS, dtype=torch.int32, device=device)
    assert counter.dtype == torch.int32 and counter.numel() >= LORA_COUNTER_INTS
    seg1, seg2 = segment_bounds(lora.segments, out_dim)
    return dict(la_ptr=a, lp_ptr=parts, lb_ptr=b, slots_ptr=lora.slots, ranks_ptr=lora.ranks,
                scales_ptr=lora.scales, cnt_ptr=counter, seg1=seg1, seg2=seg2,
                stride_lal=a.stride(0), stride_lar=a.stride(1), stride_lpt=parts.stride(0),
                stride_lps=parts.stride(1), stride_lbl=b.stride(0), stride_lbn=b.stride(1),
                R=rank, NUM_SEG=num_seg, SPLITS=splits, BLOCK_R=triton.next_power_of_2(rank),
                RANGE_K=range_k, NORM_BLOCK=min(4096, triton.next_power_of_2(in_dim)),
                REPLICAS=REPLICAS, REPLICA_STRIDE=REPLICA_STRIDE,
                SPIN_NS=0 if triton_interpreted() else SPIN_NS), lead


def _launch(mode: int, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            lora: LoRAGroup, config: tuple[int, ...], **kw) -> tuple[torch.Tensor,
                                                                    torch.Tensor | None]:
    assert 0 < x.shape[0] <= skinny.MAX_M and foldable(config)
    check_input(x, lora.a, kw.get("norm_weight"), kw.get("residual"))
    extra, lead = _lora_args(lora, x.shape[0], x.shape[1], weight.shape[0], x.device)
    return skinny._launch(mode, x, weight, bias, config, kernel=_skinny_lora_kernel,
                          extra=extra, lead_programs=lead, **kw)


def lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                lora: LoRAGroup, config: tuple[int, ...], out: torch.Tensor | None = None,
                scale: torch.Tensor | None = None, silu_pairs: bool = False) -> torch.Tensor:
    """``skinny.skinny_linear`` with ``lora``'s delta of ``x``'s rows folded in, shrink
    included (``ref.lora_linear``); ``silu_pairs``: ``weight`` is ``[gate | up]`` and the
    result ``silu_and_mul`` of that."""
    return _launch(skinny.PROLOGUE_PLAIN, x, weight, bias, lora, config, out=out,
                   scale=scale, silu_pairs=silu_pairs)[0]


def lora_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                     eps: float, weight: torch.Tensor, bias: torch.Tensor | None,
                     lora: LoRAGroup, config: tuple[int, ...],
                     scale: torch.Tensor | None = None, silu_pairs: bool = False,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``skinny.skinny_norm_linear`` with ``lora``'s delta of the normed rows folded in,
    shrink included; returns ``(y, new_residual)``. ``silu_pairs``: as for
    :func:`lora_linear`."""
    y, new_res = _launch(skinny.PROLOGUE_NORM, x, weight, bias, lora, config,
                         residual=residual, norm_weight=norm_weight, eps=eps, scale=scale,
                         silu_pairs=silu_pairs)
    return y, (x if new_res is None else new_res)
