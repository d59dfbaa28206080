"""Elementwise decode-path kernels: add + RMSNorm, SiLU·mul, and the rotary kernel.

Each matches its torch reference in ``kernels.ref`` (same name, same arguments): the kernels
round intermediate values to the model dtype exactly where transformers' Llama/Qwen modules
do (RMSNorm output before the weight multiply, each rotary product, the SiLU output), so on
the GPU they agree with the torch path to the last bit or one ulp rather than merely "within
tolerance".

* :func:`add_rms_norm` — ``residual += x`` then RMSNorm, one read of each input.
* :func:`silu_and_mul` — ``silu(gate) * up`` on the packed ``[T, 2I]`` gate_up output.
* :func:`rotary` — neox rotary on q and k, optionally preceded by Qwen3's per-head q/k
  RMSNorm and followed by the KV-cache write of k and v (one launch for the whole
  post-projection part of a layer's "before" segment).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replaylm.batch import BLOCK_SIZE
from replaylm.kernels import pdl
from replaylm.kernels.pdl import wait_for_previous
from replaylm.kernels.rope import norm_rope


@triton.jit(do_not_specialize=["num_tokens"])
def _add_rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr, rows_ptr, num_tokens, eps,
    stride_x, stride_r, stride_o, stride_nr,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    HAS_ROWS: tl.constexpr, USE_PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    src = row
    if HAS_ROWS:  # the row list is host-written: read before the wait
        src = tl.load(rows_ptr + row).to(tl.int64)
    wait_for_previous(USE_PDL)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    x = tl.load(x_ptr + src * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + src * stride_r + cols, mask=mask, other=0.0)
        # The sum is rounded to the model dtype first: that is the residual the next layer
        # reads, and the torch path normalises the rounded value too.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    tl.store(new_res_ptr + row * stride_nr + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x32 * x32, axis=0) / HIDDEN + eps)
    normed = (x32 * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``new_residual = x + residual`` (``x`` when ``residual`` is None, the first layer),
    ``normed = weight * rmsnorm(new_residual)``; returns ``(normed, new_residual)``.

    ``x``/``residual``: ``[T, H]`` with a contiguous last dim; outputs are fresh tensors.
    With ``rows`` (int64 ``[R]``, written before the step) only those rows, in that order: the
    final norm of a step gathers its logits rows this way, without an index_select launch.
    """
    hidden = x.shape[1]
    num_out = x.shape[0] if rows is None else rows.shape[0]
    normed = x.new_empty(num_out, hidden)
    new_res = x.new_empty(num_out, hidden)
    if num_out == 0:
        return normed, new_res
    res = x if residual is None else residual
    block = triton.next_power_of_2(hidden)
    _add_rmsnorm_kernel[(num_out,)](
        x, res, weight, normed, new_res, x if rows is None else rows, num_out, eps,
        x.stride(0), res.stride(0), normed.stride(0), new_res.stride(0),
        HIDDEN=hidden, BLOCK=block, HAS_RESIDUAL=residual is not None,
        HAS_ROWS=rows is not None, USE_PDL=pdl.ENABLED,
        num_warps=min(16, max(1, block // 512)), **pdl.LAUNCH,
    )
    return normed, new_res


@triton.jit(do_not_specialize=["num_tokens"])
def _silu_mul_kernel(gu_ptr, out_ptr, num_tokens, stride_gu, stride_o,
                     INTER: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_previous(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0)
    u = tl.load(gu_ptr + row * stride_gu + INTER + cols, mask=mask, other=0.0)
    g32 = g.to(tl.float32)
    act = (g32 / (1.0 + tl.exp(-g32))).to(g.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * u.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up`` ``[T, 2I]`` (gate is the first half); returns ``[T, I]``."""
    num_tokens, width = gate_up.shape
    inter = width // 2
    out = torch.empty(num_tokens, inter, device=gate_up.device, dtype=gate_up.dtype)
    if num_tokens == 0:
        return out
    assert gate_up.stride(-1) == 1
    block = min(1024, triton.next_power_of_2(inter))
    _silu_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
        gate_up, out, num_tokens, gate_up.stride(0), out.stride(0),
        INTER=inter, BLOCK=block, USE_PDL=pdl.ENABLED, num_warps=4, **pdl.LAUNCH,
    )
    return out


@triton.jit
def _norm_rope_heads(x_ptr, out_ptr, w1, w2, cos, sin, tok, h0, num_heads, stride_xt, stride_xh,
                     stride_ot, stride_oh, eps, HP: tl.constexpr, HALF: tl.constexpr,
                     HAS_NORM: tl.constexpr):
    """Normalise (optionally) and rotate heads ``h0 .. h0+HP`` (those below ``num_heads``) of
    one token; stores them and returns the rotated halves and the head mask."""
    h = h0 + tl.arange(0, HP)
    d = tl.arange(0, HALF)
    mask = (h < num_heads)[:, None]
    base = x_ptr + tok * stride_xt + h[:, None] * stride_xh + d[None, :]
    x1 = tl.load(base, mask=mask, other=0.0)
    x2 = tl.load(base + HALF, mask=mask, other=0.0)
    o1, o2 = norm_rope(x1, x2, w1, w2, cos[None, :], sin[None, :], eps, HALF, HAS_NORM)
    obase = out_ptr + tok * stride_ot + h[:, None] * stride_oh + d[None, :]
    tl.store(obase, o1, mask=mask)
    tl.store(obase + HALF, o2, mask=mask)
    return o1, o2, h, mask


@triton.jit(do_not_specialize=["num_tokens"])
def _rotary_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cs_ptr, qw_ptr, kw_ptr, q_out_ptr, k_out_ptr,
    k_cache_ptr, v_cache_ptr, slot_ptr, num_tokens, eps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_qot, stride_qoh, stride_kot, stride_koh, stride_cs,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    HQ: tl.constexpr, HKV: tl.constexpr, HP: tl.constexpr, HALF: tl.constexpr,
    HAS_NORM: tl.constexpr, WRITE_KV: tl.constexpr, PAGE: tl.constexpr, USE_PDL: tl.constexpr,
):
    # One program per (token, group of HP heads): the first cdiv(HQ, HP) groups are q heads,
    # the rest k heads (each with its v). Decode steps take HP = 1, so a program per head
    # keeps latency low; large batches take bigger groups, so fewer programs.
    tok = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    # Positions, slots, the rotary table and norm weights are not written by the previous
    # kernel: they are read before the PDL wait, overlapping it.
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    d = tl.arange(0, HALF)
    cs_row = cs_ptr + pos * stride_cs
    cos = tl.load(cs_row + d).to(q_ptr.dtype.element_ty).to(tl.float32)
    sin = tl.load(cs_row + HALF + d).to(q_ptr.dtype.element_ty).to(tl.float32)
    QG: tl.constexpr = (HQ + HP - 1) // HP  # groups of q heads
    is_q = group < QG
    w1 = cos  # placeholders without norm weights
    w2 = sin
    if HAS_NORM:
        if is_q:
            w1 = tl.load(qw_ptr + d).to(tl.float32)
            w2 = tl.load(qw_ptr + HALF + d).to(tl.float32)
        else:
            w1 = tl.load(kw_ptr + d).to(tl.float32)
            w2 = tl.load(kw_ptr + HALF + d).to(tl.float32)
    if WRITE_KV:
        slot = tl.load(slot_ptr + tok).to(tl.int64)
    wait_for_previous(USE_PDL)
    if is_q:
        _norm_rope_heads(q_ptr, q_out_ptr, w1, w2, cos, sin, tok, group * HP, HQ, stride_qt,
                         stride_qh, stride_qot, stride_qoh, eps, HP, HALF, HAS_NORM)
    else:
        k1, k2, h, mask = _norm_rope_heads(k_ptr, k_out_ptr, w1, w2, cos, sin, tok,
                                           (group - QG) * HP, HKV, stride_kt,
                                           stride_kh, stride_kot, stride_koh, eps, HP, HALF,
                                           HAS_NORM)
        if WRITE_KV:
            if slot >= 0:
                blk = slot // PAGE
                off = slot % PAGE
                kc = (k_cache_ptr + blk * stride_kcb + off * stride_kcs
                      + h[:, None] * stride_kch + d[None, :])
                tl.store(kc, k1.to(k_cache_ptr.dtype.element_ty), mask=mask)
                tl.store(kc + HALF, k2.to(k_cache_ptr.dtype.element_ty), mask=mask)
                vsrc = v_ptr + tok * stride_vt + h[:, None] * stride_vh + d[None, :]
                vc = (v_cache_ptr + blk * stride_vcb + off * stride_vcs
                      + h[:, None] * stride_vch + d[None, :])
                tl.store(vc, tl.load(vsrc, mask=mask).to(v_cache_ptr.dtype.element_ty),
                         mask=mask)
                tl.store(vc + HALF,
                         tl.load(vsrc + HALF, mask=mask).to(v_cache_ptr.dtype.element_ty),
                         mask=mask)


def rotary_heads_per_program(num_tokens: int) -> int:
    """Heads per rotary program: one for decode-sized steps (latency: the most programs),
    eight for large ones (a program per head would be tens of thousands of tiny programs)."""
    return 1 if num_tokens <= 16 else 8


def rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    *,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    v: torch.Tensor | None = None,
    k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
    heads_per_program: int | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox rotary (HF Llama ``rotate_half``) on ``q`` ``[T, Hq, D]`` and ``k`` ``[T, Hkv, D]``.

    ``cos_sin`` is the fp32 ``[max_pos, D]`` table of ``replaylm.model.config.rope_cos_sin``
    (cos in the first half, sin in the second); ``positions`` ``[T]`` index it. With
    ``q_norm_weight``/``k_norm_weight`` (``[D]``, Qwen3) each head is RMS-normalised first.
    With ``k_cache``/``v_cache``/``slot_mapping`` (and ``v``) the rotated k and v are also
    stored into the paged cache (slot < 0 skips). Inputs may be strided views of the qkv
    output (contiguous last dim); returns fresh contiguous ``(q_out, k_out)``.
    ``heads_per_program`` / ``num_warps`` override the launch shape (for latency sweeps,
    ``benchmarks/kernels.py --latency``).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert head_dim % 2 == 0 and k.shape[2] == head_dim and cos_sin.shape[1] == head_dim
    assert (q_norm_weight is None) == (k_norm_weight is None)
    q_out = torch.empty(num_tokens, num_heads, head_dim, device=q.device, dtype=q.dtype)
    k_out = torch.empty(num_tokens, num_kv_heads, head_dim, device=k.device, dtype=k.dtype)
    if num_tokens == 0:
        return q_out, k_out
    write_kv = k_cache is not None
    if write_kv:
        assert v is not None and v_cache is not None and slot_mapping is not None
        assert k_cache.shape[1] == BLOCK_SIZE
        kc, vc, vv, sm = k_cache, v_cache, v, slot_mapping
    else:
        kc, vc, vv, sm = k_out, k_out, k, positions  # dummies, never touched
    has_norm = q_norm_weight is not None
    qw = q_norm_weight if has_norm else cos_sin
    kw = k_norm_weight if has_norm else cos_sin
    kc_strides = (kc.stride(0), kc.stride(1), kc.stride(2)) if write_kv else (0, 0, 0)
    vc_strides = (vc.stride(0), vc.stride(1), vc.stride(2)) if write_kv else (0, 0, 0)
    hp = heads_per_program or rotary_heads_per_program(num_tokens)
    assert hp & (hp - 1) == 0, f"heads per program must be a power of two, got {hp}"
    groups = triton.cdiv(num_heads, hp) + triton.cdiv(num_kv_heads, hp)
    _rotary_kernel[(num_tokens, groups)](
        q, k, vv, positions, cos_sin, qw, kw, q_out, k_out, kc, vc, sm, num_tokens, eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), vv.stride(0), vv.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos_sin.stride(0),
        *kc_strides, *vc_strides,
        HQ=num_heads, HKV=num_kv_heads, HP=hp, HALF=head_dim // 2, HAS_NORM=has_norm,
        WRITE_KV=write_kv, PAGE=BLOCK_SIZE, USE_PDL=pdl.ENABLED,
        num_warps=num_warps or max(1, min(4, hp * head_dim // 256)), **pdl.LAUNCH,
    )
    return q_out, k_out
