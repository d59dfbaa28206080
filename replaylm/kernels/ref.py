"""Torch references of the decoder's dense ops: one per op, used by the model on the CPU and
by the tests as the oracle of each Triton kernel (``kernels.ops`` has the same signatures).

The numerics follow transformers' Llama/Qwen modules (RMSNorm in fp32 with its output
rounded to the model dtype before the weight multiply, each rotary product rounded in the
model dtype), so fp32 runs match transformers exactly and the kernels match these to the
last bit or one ulp. This module imports only torch: it works without Triton.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F


def split_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views of the fused qkv projection ``[T, (Hq + 2 Hkv) D]`` as q ``[T, Hq, D]``, k and v
    ``[T, Hkv, D]``."""
    t = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    return (q.view(t, num_heads, head_dim), k.view(t, num_kv_heads, head_dim),
            v.view(t, num_kv_heads, head_dim))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim (a hidden row, or one head for Qwen3's q/k norm)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``new_residual = x + residual`` (``x`` when None, the first layer), then RMSNorm;
    returns ``(normed, new_residual)``, of the token rows ``rows`` only when given."""
    if rows is not None:
        x = x.index_select(0, rows)
        residual = None if residual is None else residual.index_select(0, rows)
    residual = x if residual is None else residual + x
    return rms_norm(residual, weight, eps), residual


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up`` ``[T, 2I]`` (gate is the first half)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def apply_rotary(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotary on ``[T, H, D]`` (rotate the two halves), as HF Llama does;
    ``cos_sin`` is the fp32 ``[max_pos, D]`` table of ``model.config.rope_cos_sin``."""
    half = x.shape[-1] // 2
    cs = cos_sin[positions].to(x.dtype)  # [T, D]: cos | sin, each D/2
    cos = torch.cat([cs[:, :half], cs[:, :half]], -1)[:, None, :]
    sin = torch.cat([cs[:, half:], cs[:, half:]], -1)[:, None, :]
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' K/V ``[T, Hkv, D]`` at their cache slots (graph safe)."""
    hkv, d = k_cache.shape[-2:]
    k_cache.view(-1, hkv, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, hkv, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's post-projection work: q/k norm (Qwen3, when the weights are given), rotary,
    and with ``k_cache``/``v_cache``/``slot_mapping`` (and ``v``) the KV write; returns the
    rotated ``(q, k)``."""
    if q_norm_weight is not None:
        q = rms_norm(q, q_norm_weight, eps)
    if k_norm_weight is not None:
        k = rms_norm(k, k_norm_weight, eps)
    q, k = apply_rotary(q, positions, cos_sin), apply_rotary(k, positions, cos_sin)
    if k_cache is not None:
        assert v is not None and v_cache is not None and slot_mapping is not None
        write_kv(k, v, k_cache, v_cache, slot_mapping)
    return q, k


#: The FP8 format of quantized weights and its largest finite value.
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` ``[..., N, K]`` as ``float8_e4m3fn`` with one float32 scale per output row
    (``[..., N]``): ``scale = amax(|row|) / 448``, ``q = round(row / scale)``; an all-zero row
    gets scale 1 (its values stay 0). ``dequantize(q, scale)`` gives the weight back within
    e4m3's 3-bit mantissa."""
    w = weight.float()
    amax = w.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


#: Smallest per-token activation scale (``quantize_rows``): a row of zeros quantizes to
#: zeros instead of dividing by 0.
MIN_ROW_SCALE = 1e-12


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token quantization for W8A8: ``x`` ``[M, K]`` as ``float8_e4m3fn`` with
    one float32 scale per row (``[M, 1]``, ``max(amax / 448, MIN_ROW_SCALE)``). The kernel
    (``fp8_linear.quantize_rows``) gives the same scales and values; a negative value that
    rounds to zero is +0 there and -0 here."""
    xf = x.float()
    amax = xf.abs().amax(dim=1, keepdim=True)
    # Divided by a tensor on amax's device: a CUDA tensor divided by a Python number is
    # multiplied by the number's reciprocal instead, an ulp off for some rows.
    scale = (amax / amax.new_full((), FP8_MAX)).clamp_min(MIN_ROW_SCALE)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def dequantize(weight: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype,
               ) -> torch.Tensor:
    """``weight`` in ``dtype``: an FP8 weight times its per-row ``scale`` (computed in fp32,
    then rounded once), any other weight as it is."""
    if scale is None:
        return weight if weight.dtype == dtype else weight.to(dtype)
    return (weight.float() * scale[..., None]).to(dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None, scale: torch.Tensor | None = None,
           lora: LoRAGroup | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``, written into ``out`` when given. ``scale``: the per-row
    float32 scales of an FP8 ``weight`` (``quantize_fp8``), which is dequantized to ``x``'s
    dtype first. ``lora``: the adapters, whose delta of ``x`` is folded in before the one
    rounding (:func:`lora_linear`)."""
    if lora is not None:
        y = lora_linear(x, weight, bias, lora.shrink(x), scale)
        return y if out is None else out.copy_(y)
    if scale is not None:
        weight = dequantize(weight, scale, x.dtype)
    if out is None:
        return F.linear(x, weight, bias)
    if bias is None:
        return torch.mm(x, weight.t(), out=out)
    return torch.addmm(bias, x, weight.t(), out=out)


def norm_linear(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
    weight: torch.Tensor, bias: torch.Tensor | None = None, scale: torch.Tensor | None = None,
    lora: LoRAGroup | None = None, silu_out: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add + RMSNorm, then a projection; returns ``(projection, new_residual)``.
    ``silu_out``: ``weight`` is ``[gate | up]``, and the projection is ``silu_and_mul`` of it."""
    normed, residual = add_rms_norm(x, residual, norm_weight, eps)
    y = linear(normed, weight, bias, scale=scale, lora=lora)
    return (silu_and_mul(y) if silu_out else y), residual


def silu_linear(gate_up: torch.Tensor, weight: torch.Tensor,
                scale: torch.Tensor | None = None) -> torch.Tensor:
    """SiLU-and-mul, then a projection (down_proj)."""
    return linear(silu_and_mul(gate_up), weight, scale=scale)


def route_topk(router_logits: torch.Tensor, top_k: int, normalize: bool,
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing of ``router_logits`` ``[T, E]``: softmax in fp32, the ``top_k`` largest
    probabilities (renormalised to sum to 1 when ``normalize``); returns ``(weights, ids)``
    ``[T, top_k]``, the weights in the logits' dtype, as transformers' Qwen MoE routers do."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


def shared_combine(routed: torch.Tensor, shared: torch.Tensor, x: torch.Tensor,
                   gate_weight: torch.Tensor) -> torch.Tensor:
    """A Qwen2-MoE block's output: the routed experts' ``routed`` plus the shared expert's
    ``shared`` scaled by its gate ``sigmoid(x @ gate_weight^T)`` (``gate_weight`` ``[1, H]``,
    one scalar per row)."""
    return routed + torch.sigmoid(linear(x, gate_weight)) * shared


def fused_moe(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              gate_up_scale: torch.Tensor | None = None,
              down_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Routed experts: ``sum_k weight[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` over the
    chosen experts ``e = ids[t, k]``, with ``w_gate_up`` ``[E, 2I, H]`` (gate | up) and
    ``w_down`` ``[E, H, I]``.

    Graph safe (no host sync, no data-dependent shape): each expert runs on every row and
    rows that did not choose it get weight 0, summed in expert order as transformers does.
    Every expert's weights are read whatever the routing; ``kernels.ops`` has the grouped
    path that reads only the chosen ones. ``gate_up_scale`` ``[E, 2I]`` / ``down_scale``
    ``[E, H]``: the per-row scales of FP8 expert weights.
    """
    num_experts = w_gate_up.shape[0]
    dense = torch.zeros(x.shape[0], num_experts, dtype=topk_weights.dtype, device=x.device)
    dense.scatter_(1, topk_ids, topk_weights)  # [T, E]: routing weight, 0 where not chosen
    out = torch.zeros_like(x)
    for e in range(num_experts):
        gu_scale = None if gate_up_scale is None else gate_up_scale[e]
        d_scale = None if down_scale is None else down_scale[e]
        y = linear(silu_and_mul(linear(x, w_gate_up[e], scale=gu_scale)), w_down[e],
                   scale=d_scale)
        # A row that did not choose e adds exactly 0 (padding rows may carry NaN: they are
        # dropped, and rows never mix here).
        out += torch.where(dense[:, e, None] != 0, y * dense[:, e, None], 0.0)
    return out


def lora_input(x: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
               residual: torch.Tensor | None = None) -> torch.Tensor:
    """The rows a LoRA shrink reads, from a projection's raw input ``x``: with
    ``norm_weight`` the RMSNorm of ``x + residual`` (``x`` when None: the new residual of a
    fused residual add + RMSNorm + projection), else ``x`` itself. The same roundings as the
    separate ops."""
    if norm_weight is not None:
        return add_rms_norm(x, residual, norm_weight, eps)[0]
    return x


def lora_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor,
                ranks: torch.Tensor, num_segments: int = 1,
                norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                residual: torch.Tensor | None = None) -> torch.Tensor:
    """The first half of a LoRA delta: row ``t`` of the result is ``u[t] @ a[slots[t]]^T``
    (``a`` ``[L, S*R, in]``: ``L`` adapter slots, ``S`` output segments of ``R`` rank rows
    each), in ``x``'s dtype, ``u = lora_input(x, norm_weight, eps, residual)``; rows
    whose slot is -1 or holds no adapter (rank 0) are 0.

    Graph safe: every slot's product runs on every row and each row keeps its own slot's.
    ``num_segments`` is the kernel's launch shape; rows past a slot's rank are zero in
    ``a`` (``replaylm.lora`` pads them), so the product needs no mask here.
    """
    x = lora_input(x, norm_weight, eps, residual)
    out = torch.zeros(x.shape[0], a.shape[1], dtype=x.dtype, device=x.device)
    for slot in range(a.shape[0]):
        rows = ((slots == slot) & (ranks[slot] > 0))[:, None]
        out = torch.where(rows, linear(x, a[slot]), out)
    return out


def lora_expand(y: torch.Tensor, s: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                ranks: torch.Tensor, scales: torch.Tensor,
                segments: tuple[int, ...]) -> torch.Tensor:
    """The second half of a LoRA delta: ``y[t] + scales[slot] * s[t, seg] @ b[slot, seg]^T``
    per output segment (``segments``: the widths of the projection's output pieces, e.g.
    q, k, v; ``s`` holds ``R`` columns per segment, ``b`` is ``[L, out, R]``), ``slot =
    slots[t]``; rows whose slot is -1 or holds no adapter come back unchanged. Only a
    slot's first ``ranks[slot]`` columns of each segment of ``s`` are read, as the kernels
    read them: ``kernels.lora.lora_shrink`` leaves the rest unwritten (any bits, NaN too)."""
    rank = b.shape[-1]
    for slot in range(b.shape[0]):
        in_rank = torch.arange(rank, device=s.device) < ranks[slot]
        parts, start = [], 0
        for j, width in enumerate(segments):
            sj = torch.where(in_rank, s[:, j * rank:(j + 1) * rank], 0.0)
            parts.append(linear(sj, b[slot, start:start + width]))
            start += width
        delta = torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]
        rows = ((slots == slot) & (ranks[slot] > 0))[:, None]
        y = torch.where(rows, y + delta * scales[slot], y)
    return y


def lora_add(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             slots: torch.Tensor, ranks: torch.Tensor, scales: torch.Tensor,
             segments: tuple[int, ...], norm_weight: torch.Tensor | None = None,
             eps: float = 0.0, residual: torch.Tensor | None = None) -> torch.Tensor:
    """A whole LoRA delta added to a projection's output ``y``: ``lora_shrink`` of the raw
    input ``x`` (its prologue: ``lora_input``), rounded to ``x``'s dtype, then
    ``lora_expand``; the reference of ``kernels.lora.lora_add`` (both of its paths)."""
    s = lora_shrink(x, a, slots, ranks, len(segments), norm_weight, eps, residual)
    return lora_expand(y, s, b, slots, ranks, scales, segments)


@dataclasses.dataclass(frozen=True)
class LoRADelta:
    """A projection's adapter delta, shrunk and waiting to be added (:meth:`LoRAGroup.shrink`):
    what :func:`lora_linear`, ``kernels.skinny_lora`` and the expands take.

    ``s``: the shrink of the projection's input rows, as the module that made it returns it:
    ``lora_shrink``'s rows ``[T, S*R]`` in the model dtype, or ``kernels.lora.lora_shrink``'s
    fp32 partial sums ``[T, splits, S*R]`` over ``K`` ranges. ``b`` ``[L, out, R]``, ``slots``
    ``[T]``, ``ranks`` ``[L]``, ``scales`` ``[L]`` and ``segments`` as in ``lora_expand``."""

    s: torch.Tensor
    b: torch.Tensor
    slots: torch.Tensor
    ranks: torch.Tensor
    scales: torch.Tensor
    segments: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class LoRAGroup:
    """A projection group's adapters for a step (``replaylm.lora``): what ``linear`` and
    ``norm_linear`` (here and in ``kernels.ops``) take as ``lora``.

    The op shrinks the rows its projection reads (:meth:`shrink`) right before the
    projection's launch: the raw input with the norm prologue where one kernel does both,
    else the rows it is given. ``a`` ``[L, S*R, in]``, ``b``, ``ranks``,
    ``scales`` and ``segments`` as in ``lora_shrink`` and ``lora_expand``; ``slots``: the
    step's per-token slots (at least as many as the op's rows; the first ``T`` are read);
    ``shrink_op``: :func:`lora_shrink`, or ``kernels.lora.lora_shrink`` on CUDA."""

    a: torch.Tensor
    b: torch.Tensor
    slots: torch.Tensor
    ranks: torch.Tensor
    scales: torch.Tensor
    segments: tuple[int, ...]
    shrink_op: Callable[..., torch.Tensor]

    def shrink(self, x: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
               residual: torch.Tensor | None = None) -> LoRADelta:
        """The delta of ``x``'s rows: the prologue's rows of ``x`` (``lora_input``'s
        arguments) shrunk."""
        slots = self.slots[: x.shape[0]]
        s = self.shrink_op(x, self.a, slots, self.ranks, len(self.segments), norm_weight, eps,
                           residual)
        return LoRADelta(s, self.b, slots, self.ranks, self.scales, self.segments)


def lora_delta(lora: LoRADelta, dtype: torch.dtype) -> torch.Tensor:
    """``scales[slot] * s[t, seg] @ b[slot, seg]^T`` per row in fp32 (0 on rows of slot -1
    or of an empty slot), from the shrink rounded to ``dtype`` (partial sums are added
    first, then rounded, as ``kernels.lora.lora_expand`` does)."""
    s = lora.s.sum(1) if lora.s.dim() == 3 else lora.s
    s = s.to(dtype).float()
    zero = torch.zeros(s.shape[0], lora.b.shape[1], dtype=torch.float32, device=s.device)
    return lora_expand(zero, s, lora.b.float(), lora.slots, lora.ranks, lora.scales,
                       lora.segments)


def lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                lora: LoRADelta, scale: torch.Tensor | None = None) -> torch.Tensor:
    """A projection with its adapter delta folded in (the rule of the skinny kernel's LoRA
    epilogue, ``kernels.skinny_lora``): ``x @ weight^T + bias`` and :func:`lora_delta`
    added in fp32, then rounded to ``x``'s dtype once. (The separate ``lora_expand`` adds
    the rounded delta to the already rounded projection.)"""
    y = F.linear(x.float(), dequantize(weight, scale, torch.float32),
                 None if bias is None else bias.float())
    return (y + lora_delta(lora, x.dtype)).to(x.dtype)
