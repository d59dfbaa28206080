"""The Triton programs of paged varlen attention (``kernels.attention`` launches them and
documents the work decomposition)."""

from __future__ import annotations

import triton
import triton.language as tl

from replaylm.kernels.dot import dot
from replaylm.kernels.pdl import wait_for_previous
from replaylm.kernels.rope import norm_rope

LOG2E = 1.4426950408889634
#: Split partials the decode-with-rotary variant's merge loads per round trip (the other
#: variants load one: the wider load's registers cost them more than it saves).
ROPE_MERGE_BATCH = tl.constexpr(4)


@triton.jit
def _lookup_request(cu_q_ptr, tile, num_reqs, BQ: tl.constexpr, CHUNK: tl.constexpr):
    """Index ``i`` of the last slot with ``cu_seqlens_q[i] // BQ + i <= tile`` (``num_reqs``
    when the tile lies past every request, i.e. in the padding sink)."""
    count = 0
    for s0 in range(0, num_reqs + 1, CHUNK):
        idx = s0 + tl.arange(0, CHUNK)
        ok = idx <= num_reqs
        cu = tl.load(cu_q_ptr + idx, mask=ok, other=0)
        hit = ok & ((cu // BQ + idx) <= tile)
        count += tl.sum(hit.to(tl.int32), axis=0)
    return count - 1


@triton.jit
def _attn_step(acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row_ptr, start, hi, q_pos,
               offs_d, stride_kb, stride_ks, stride_vb, stride_vs, sm_scale_log2,
               BLOCK_N: tl.constexpr, PAGE: tl.constexpr, MASKED: tl.constexpr):
    """Fold keys ``start .. start+BLOCK_N`` into the online softmax.

    ``MASKED`` is False on the fully visible prefix of the tile, which saves the causal /
    range mask and the -inf guards on most iterations of a long prefill.
    """
    keys = start + tl.arange(0, BLOCK_N)
    if MASKED:
        kmask = keys < hi
        blk = tl.load(bt_row_ptr + keys // PAGE, mask=kmask, other=0).to(tl.int64)
    else:
        blk = tl.load(bt_row_ptr + keys // PAGE).to(tl.int64)
    in_blk = (keys % PAGE).to(tl.int64)
    k_ptrs = k_cache_ptr + (blk * stride_kb + in_blk * stride_ks)[:, None] + offs_d[None, :]
    v_ptrs = v_cache_ptr + (blk * stride_vb + in_blk * stride_vs)[:, None] + offs_d[None, :]
    if MASKED:
        k = tl.load(k_ptrs, mask=kmask[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=kmask[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    return _attn_update(acc, l_i, m_i, q, k, v, keys, hi, q_pos, sm_scale_log2, MASKED)


@triton.jit
def _attn_update(acc, l_i, m_i, q, k, v, keys, hi, q_pos, sm_scale_log2, MASKED: tl.constexpr):
    """Fold a loaded key block ``k``/``v`` (key positions ``keys``) into the online softmax."""
    s = dot(q, tl.trans(k)) * sm_scale_log2
    if MASKED:
        visible = (keys[None, :] <= q_pos[:, None]) & (keys < hi)[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row may see no key in this block (e.g. a split range past its causal bound);
        # shifting by 0 instead of -inf keeps exp2 from producing NaN.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = m_new
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v)
    return acc, l_i, m_new


@triton.jit
def _key_range(kv_len, q_len, j, split, num_splits, BQ: tl.constexpr, BLOCK_N: tl.constexpr,
               MIN_SPLIT: tl.constexpr, IS_SPLIT: tl.constexpr):
    """Keys ``lo .. hi`` that tile ``j`` of a request folds in for split ``split``, from the
    request's lengths alone; ``tile_hi``: keys the tile's last row can see; ``per``: keys per
    split (``tile_hi`` without split-KV). ``lo >= hi`` when the split has no keys."""
    tile_hi = tl.minimum(kv_len - q_len + j * BQ + BQ, kv_len)
    lo = 0
    hi = tile_hi
    per = tile_hi
    if IS_SPLIT:
        per = tl.maximum(tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N, MIN_SPLIT)
        lo = split * per
        hi = tl.minimum(tile_hi, lo + per)
    return lo, hi, tile_hi, per


@triton.jit(do_not_specialize=["num_tokens", "num_reqs", "num_splits", "stride_bt"])
def _paged_attn_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_o_ptr, part_ml_ptr, counter_ptr,
    cu_q_ptr, kv_lens_ptr, block_table_ptr,
    kn_ptr, vn_ptr, pos_ptr, cs_ptr, qw_ptr, kw_ptr, slot_ptr, eps,
    sm_scale_log2, num_tokens, num_reqs, num_splits,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    stride_knt, stride_knh, stride_vnt, stride_vnh, stride_cs,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, BQ: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, IS_SPLIT: tl.constexpr, MIN_SPLIT: tl.constexpr,
    ROPE: tl.constexpr, HAS_QK_NORM: tl.constexpr, CHUNK: tl.constexpr, USE_PDL: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BQ * G_PAD
    HALF: tl.constexpr = HEAD_DIM // 2
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    # The batch layout (cu_seqlens_q, kv_lens) is written before the step's first kernel,
    # never by the previous one: the request lookup runs before the PDL wait, overlapping
    # the previous kernel. Only q and the newest keys (written by the rotary kernel) wait.
    req = _lookup_request(cu_q_ptr, tile, num_reqs, BQ, CHUNK)
    in_req = req < num_reqs
    q_start = tl.load(cu_q_ptr + req)  # the total token count for a sink tile
    q_len = tl.load(cu_q_ptr + req + 1, mask=in_req, other=0) - q_start
    kv_len = tl.load(kv_lens_ptr + req, mask=in_req, other=0)
    if ROPE:
        # Decode (one new token per request): the token's position and slot, the rotary
        # table row and the q/k norm weights are not written by the previous kernel either.
        has_tok = in_req & (q_len > 0)
        dh = tl.arange(0, HALF)
        pos = tl.load(pos_ptr + q_start, mask=has_tok, other=0).to(tl.int64)
        new_slot = tl.load(slot_ptr + q_start, mask=has_tok, other=-1).to(tl.int64)
        cos = tl.load(cs_ptr + pos * stride_cs + dh).to(q_ptr.dtype.element_ty).to(tl.float32)
        sin = tl.load(cs_ptr + pos * stride_cs + HALF + dh).to(q_ptr.dtype.element_ty)
        sin = sin.to(tl.float32)
        qw1 = cos  # placeholders without q/k norm
        qw2 = sin
        kw1 = cos
        kw2 = sin
        if HAS_QK_NORM:
            qw1 = tl.load(qw_ptr + dh).to(tl.float32)
            qw2 = tl.load(qw_ptr + HALF + dh).to(tl.float32)
            kw1 = tl.load(kw_ptr + dh).to(tl.float32)
            kw2 = tl.load(kw_ptr + HALF + dh).to(tl.float32)
    offs_d = tl.arange(0, HEAD_DIM)
    if ROPE:
        # The program's key range comes from host-written lengths as well.
        j0 = tile - (q_start // BQ + req)
        p_lo, p_hi, _, _ = _key_range(kv_len, q_len, j0, split, num_splits, BQ, BLOCK_N,
                                      MIN_SPLIT, IS_SPLIT)
        # Programs with no keys and no padding rows to zero leave before the wait, so they
        # take no SM slot while it lasts. Program (0, 0, 0) always waits: the launch still
        # completes only after its predecessor.
        idle = (in_req & ((j0 * BQ >= q_len) | (p_lo >= p_hi))) | ((req >= num_reqs) & (split > 0))
        if idle & ((tile + kvh + split) > 0):
            return
        # Keys and values below the newest position were written by earlier steps, not by a
        # kernel of this one: the first key block is loaded before the wait (the newest key
        # and value are patched in after it), so its load overlaps the qkv projection.
        pkeys = p_lo + tl.arange(0, BLOCK_N)
        pmask = in_req & (j0 * BQ < q_len) & (pkeys < p_hi) & (pkeys < kv_len - 1)
        bt_pre = block_table_ptr + req.to(tl.int64) * stride_bt
        pblk = tl.load(bt_pre + pkeys // PAGE, mask=pmask, other=0).to(tl.int64)
        pin = (pkeys % PAGE).to(tl.int64)
        k_pre = tl.load(k_cache_ptr + kvh * stride_kh
                        + (pblk * stride_kb + pin * stride_ks)[:, None] + offs_d[None, :],
                        mask=pmask[:, None], other=0.0)
        v_pre = tl.load(v_cache_ptr + kvh * stride_vh
                        + (pblk * stride_vb + pin * stride_vs)[:, None] + offs_d[None, :],
                        mask=pmask[:, None], other=0.0)
    wait_for_previous(USE_PDL)

    rows = tl.arange(0, BLOCK_M)
    head = kvh * GROUP + rows % G_PAD
    head_ok = (rows % G_PAD) < GROUP

    if not in_req:
        # Padding sink: zero the rows of tokens that belong to no request (split 0 only).
        if split == 0:
            total = q_start
            tok = (total // BQ + (tile - (total // BQ + num_reqs))) * BQ + rows // G_PAD
            ok = (tok >= total) & (tok < num_tokens) & head_ok
            o_ptrs = out_ptr + tok.to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
            zero = tl.zeros([BLOCK_M, HEAD_DIM], dtype=out_ptr.dtype.element_ty)
            tl.store(o_ptrs, zero, mask=ok[:, None])
        return

    j = tile - (q_start // BQ + req)
    if j * BQ >= q_len:
        return
    ctx_start = kv_len - q_len  # absolute position of the request's first new token

    tok_local = j * BQ + rows // G_PAD
    row_ok = (tok_local < q_len) & head_ok
    q_pos = ctx_start + tok_local
    tok = (q_start + tok_local).to(tl.int64)
    if ROPE:
        # q arrives as the raw projection: normalise and rotate it here, as halves, then put
        # the halves side by side again ([BM, HALF, 2] -> [BM, 2, HALF] -> [BM, D]).
        qh = q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + dh[None, :]
        o1, o2 = norm_rope(tl.load(qh, mask=row_ok[:, None], other=0.0),
                           tl.load(qh + HALF, mask=row_ok[:, None], other=0.0),
                           qw1, qw2, cos[None, :], sin[None, :], eps, HALF, HAS_QK_NORM)
        q = tl.reshape(tl.permute(tl.join(o1, o2), (0, 2, 1)), (BLOCK_M, HEAD_DIM))
    else:
        q_ptrs = q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
        q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)

    min_pos = ctx_start + j * BQ
    lo, hi, tile_hi, per = _key_range(kv_len, q_len, j, split, num_splits, BQ, BLOCK_N,
                                      MIN_SPLIT, IS_SPLIT)
    if IS_SPLIT:
        if lo >= tile_hi:  # no keys for this split: it takes no part in the merge either
            return
    # Keys below min_pos + 1 are visible to every row of the tile: no mask needed there.
    full_hi = lo + tl.maximum(tl.minimum(hi, min_pos + 1) - lo, 0) // BLOCK_N * BLOCK_N

    if ROPE:
        # The new key (position kv_len - 1), normalised and rotated here, and its value: they
        # are patched into the prefetched block below, and the one program whose key range
        # holds them stores them into the cache before any later block of its range is read
        # (no other program reads that key in a decode step).
        kn = kn_ptr + q_start.to(tl.int64) * stride_knt + kvh * stride_knh + dh[None, :]
        k1, k2 = norm_rope(tl.load(kn), tl.load(kn + HALF), kw1, kw2, cos[None, :],
                           sin[None, :], eps, HALF, HAS_QK_NORM)
        k_new = tl.reshape(tl.permute(tl.join(k1, k2), (0, 2, 1)), (1, HEAD_DIM))
        v_new = tl.load(vn_ptr + q_start.to(tl.int64) * stride_vnt + kvh * stride_vnh
                        + offs_d)[None, :]
        if (kv_len - 1 >= lo) & (kv_len - 1 < hi) & (new_slot >= 0):
            blk = new_slot // PAGE
            off = new_slot % PAGE
            kc = k_cache_ptr + blk * stride_kb + off * stride_ks + kvh * stride_kh + offs_d[None, :]
            vc = v_cache_ptr + blk * stride_vb + off * stride_vs + kvh * stride_vh + offs_d[None, :]
            tl.store(kc, k_new.to(k_cache_ptr.dtype.element_ty))
            tl.store(vc, v_new.to(v_cache_ptr.dtype.element_ty))
            tl.debug_barrier()  # the CTA's loads below see these stores
    bt_row_ptr = block_table_ptr + req.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    kv_off_k = kvh * stride_kh
    kv_off_v = kvh * stride_vh
    if ROPE:
        # The block loaded before the wait, with the new key and value in their place.
        keys0 = lo + tl.arange(0, BLOCK_N)
        is_new = (keys0 == kv_len - 1)[:, None]
        k_blk = tl.where(is_new, k_new.to(k_pre.dtype), k_pre)
        v_blk = tl.where(is_new, v_new.to(v_pre.dtype), v_pre)
        acc, l_i, m_i = _attn_update(acc, l_i, m_i, q, k_blk, v_blk, keys0, hi, q_pos,
                                     sm_scale_log2, True)
        lo = lo + BLOCK_N
        full_hi = tl.maximum(full_hi, lo)
    for start in range(lo, full_hi, BLOCK_N):
        acc, l_i, m_i = _attn_step(acc, l_i, m_i, q, k_cache_ptr + kv_off_k, v_cache_ptr + kv_off_v,
                                   bt_row_ptr, start, hi, q_pos, offs_d,
                                   stride_kb, stride_ks, stride_vb, stride_vs, sm_scale_log2,
                                   BLOCK_N, PAGE, False)
    for start in range(full_hi, hi, BLOCK_N):
        acc, l_i, m_i = _attn_step(acc, l_i, m_i, q, k_cache_ptr + kv_off_k, v_cache_ptr + kv_off_v,
                                   bt_row_ptr, start, hi, q_pos, offs_d,
                                   stride_kb, stride_ks, stride_vb, stride_vs, sm_scale_log2,
                                   BLOCK_N, PAGE, True)

    finish = kv_len >= 0  # a program writes the final rows unless a split defers it
    if IS_SPLIT:
        active = tl.cdiv(tile_hi, per)  # splits of this tile that have keys (lo < hi)
        if active > 1:
            # Partials are [T, Hq, num_splits, D] (un-normalised) and [T, Hq, num_splits, 2]
            # (m, l). The last split of the tile to finish merges them: no second launch.
            part_row = (tok * (tl.num_programs(1) * GROUP) + head) * num_splits
            po_ptrs = part_o_ptr + (part_row + split)[:, None] * HEAD_DIM + offs_d[None, :]
            tl.store(po_ptrs, acc, mask=row_ok[:, None])
            tl.store(part_ml_ptr + (part_row + split) * 2, m_i, mask=row_ok)
            tl.store(part_ml_ptr + (part_row + split) * 2 + 1, l_i, mask=row_ok)
            tl.debug_barrier()  # every thread's partials are written before the release
            count_ptr = counter_ptr + tile * tl.num_programs(1) + kvh
            arrived = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
            finish = arrived == active - 1
            if finish:
                tl.atomic_xchg(count_ptr, 0, sem="relaxed", scope="gpu")  # ready for reuse
                acc, l_i = _merge_splits(part_o_ptr, part_ml_ptr, part_row, active, row_ok,
                                         offs_d, BLOCK_M, HEAD_DIM,
                                         ROPE_MERGE_BATCH if ROPE else 1)
    if finish:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_ptrs = out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _merge_splits(part_o_ptr, part_ml_ptr, part_row, active, row_ok, offs_d,
                  BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, BATCH: tl.constexpr = 1):
    """Sum the ``active`` split partials of a tile's rows in one pass, rescaling the running
    sum whenever the max grows (as the attention loop does); returns the un-normalised output
    and its softmax denominator. Loads bypass L1 (``.cg``): other SMs wrote them. With
    ``BATCH`` > 1 that many partials are loaded per round trip (``ROPE_MERGE_BATCH``)."""
    m_run = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    l_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    if BATCH == 1:
        for sp in range(0, active):
            row = part_row + sp
            m = tl.load(part_ml_ptr + row * 2, mask=row_ok, other=float("-inf"),
                        cache_modifier=".cg")
            l_s = tl.load(part_ml_ptr + row * 2 + 1, mask=row_ok, other=0.0, cache_modifier=".cg")
            o = tl.load(part_o_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
                        mask=row_ok[:, None], other=0.0, cache_modifier=".cg")
            m_new = tl.maximum(m_run, m)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet
            alpha = tl.exp2(m_run - m_use)
            w = tl.exp2(m - m_use)
            acc = acc * alpha[:, None] + o * w[:, None]
            l_sum = l_sum * alpha + l_s * w
            m_run = m_new
    else:
        for s0 in range(0, active, BATCH):
            sp = s0 + tl.arange(0, BATCH)
            ok = row_ok[:, None] & (sp < active)[None, :]  # [BM, BATCH]
            row = part_row[:, None] + sp[None, :]
            m = tl.load(part_ml_ptr + row * 2, mask=ok, other=float("-inf"), cache_modifier=".cg")
            l_s = tl.load(part_ml_ptr + row * 2 + 1, mask=ok, other=0.0, cache_modifier=".cg")
            o = tl.load(part_o_ptr + row[:, :, None] * HEAD_DIM + offs_d[None, None, :],
                        mask=ok[:, :, None], other=0.0, cache_modifier=".cg")
            m_new = tl.maximum(m_run, tl.max(m, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_run - m_use)
            w = tl.exp2(m - m_use[:, None])  # 0 for absent splits (m = -inf)
            acc = acc * alpha[:, None] + tl.sum(o * w[:, :, None], axis=1)
            l_sum = l_sum * alpha + tl.sum(l_s * w, axis=1)
            m_run = m_new
    return acc, l_sum
