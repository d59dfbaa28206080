"""The decoder's dense ops on CUDA: the same names and signatures as the torch references
in ``kernels.ref``, so a layer calls ``(kernels or ref).norm_linear(...)`` either way.

* ``add_rms_norm``, ``silu_and_mul``, ``rotary`` — the elementwise kernels
  (``kernels.elementwise``).
* :func:`linear` — the layers' projections and the LM head: at a few rows the faster of
  cuBLAS and the skinny kernel (``kernels.skinny``), measured per shape (``kernels.tuner``);
  cuBLAS above ``skinny.MAX_M`` rows. FP8 weights (a ``scale`` given) take the skinny
  kernel's FP8 variant or ``fp8_linear.matmul`` (W8A8 ``torch._scaled_mm``, or dequantize
  + cuBLAS) the same way.
* :func:`norm_linear` / :func:`silu_linear` — ``add_rms_norm`` or ``silu_and_mul`` followed
  by ``linear``; at a few rows, when measured faster, one skinny-kernel launch that computes
  its own input rows.
* ``lora`` (of :func:`linear` and :func:`norm_linear`): each projection group's adapters
  (``ref.LoRAGroup``). The op launches their shrink right before the projection, from the
  rows the projection reads: the raw input with the fused norm prologue, else the rows it is
  given (down's are the activated rows gate_up's epilogue stored). The delta is then
  folded into the skinny kernel's epilogue (``kernels.skinny_lora``) where the projection
  runs a whole-K skinny tile, else added after the projection by ``lora.lora_expand``. The
  tile is the one the tuner chose for the projection without LoRA.
* :func:`route_topk` — MoE routing: one Triton launch on CUDA (``kernels.moe_route``).
* :func:`fused_moe` — the routed experts on CUDA: per-assignment GEMVs
  (``kernels.moe_decode``) up to ``moe_decode.MAX_ASSIGNMENTS`` (token, expert) pairs, the
  grouped kernels (``kernels.moe``) above; the torch reference elsewhere.
* :func:`shared_combine` — the shared expert's gated add, one launch on CUDA.
"""

from __future__ import annotations

import torch

from replaylm.kernels import (
    fp8_linear,
    moe,
    moe_decode,
    moe_route,
    ref,
    skinny,
    skinny_lora,
    tuner,
)
from replaylm.kernels.elementwise import add_rms_norm, rotary, silu_and_mul
from replaylm.kernels.lora import lora_expand
from replaylm.kernels.ref import FP8_DTYPE, LoRADelta, LoRAGroup, split_qkv

__all__ = ["add_rms_norm", "fused_moe", "linear", "norm_linear", "rotary", "route_topk",
           "shared_combine", "silu_and_mul", "silu_linear", "split_qkv"]


def route_topk(router_logits: torch.Tensor, top_k: int, normalize: bool,
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """MoE routing (``ref.route_topk``): one fused launch on CUDA."""
    if not router_logits.is_cuda:
        return ref.route_topk(router_logits, top_k, normalize)
    return moe_route.route_topk(router_logits, top_k, normalize)


def fused_moe(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              gate_up_scale: torch.Tensor | None = None,
              down_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The routed experts (``ref.fused_moe``) on CUDA, reading only the chosen experts'
    weights: per-assignment GEMVs for at most ``moe_decode.MAX_ASSIGNMENTS`` (token,
    expert) pairs (a host-known count: a tier always takes the same path), the grouped
    kernels above. FP8 experts: the same kernels with the scales in their epilogues."""
    scales = (gate_up_scale, down_scale)
    if not x.is_cuda:
        return ref.fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids, *scales)
    if topk_ids.numel() <= moe_decode.MAX_ASSIGNMENTS:
        return moe_decode.gemv_moe(x, w_gate_up, w_down, topk_weights, topk_ids, *scales)
    return moe.fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids, *scales)


def shared_combine(routed: torch.Tensor, shared: torch.Tensor, x: torch.Tensor,
                   gate_weight: torch.Tensor) -> torch.Tensor:
    """``routed + sigmoid(x @ gate_weight^T) * shared`` (``ref.shared_combine``): one launch
    on CUDA, gate included."""
    if not x.is_cuda:
        return ref.shared_combine(routed, shared, x, gate_weight)
    return moe_route.shared_combine(routed, shared, x, gate_weight)


def _few_rows(x: torch.Tensor) -> bool:
    return 0 < x.shape[0] <= skinny.MAX_M and x.is_cuda


def row_block(rows: int) -> int:
    """The tuner key's row count: ``rows`` rounded up to the kernel's row block. Every row
    count of a block takes the same choice, so on a skinny tile a row's sums do not depend on
    how many rows share its step (an eager step of 5 rows and a graph tier of 8 agree bit for
    bit; cuBLAS makes no such promise across row counts)."""
    return 1 << (rows - 1).bit_length()


def _kind(kind: str, weight: torch.Tensor) -> str:
    """The tuner key's kind: the prologue, marked ``-fp8`` for FP8 weights (their own
    kernels, candidates and decisions)."""
    return f"{kind}-fp8" if weight.dtype == FP8_DTYPE else kind


def _shrink(lora: LoRAGroup | None, x: torch.Tensor, **prologue) -> LoRADelta | None:
    """``lora``'s delta of ``x``'s rows (``LoRAGroup.shrink``); None without adapters."""
    return None if lora is None else lora.shrink(x, **prologue)


def _expand(y: torch.Tensor, delta: LoRADelta | None) -> torch.Tensor:
    """``y`` plus ``delta``, in place (``lora.lora_expand``); ``y`` without one."""
    if delta is None:
        return y
    return lora_expand(y, delta.s, delta.b, delta.slots, delta.ranks, delta.scales,
                       delta.segments)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None, scale: torch.Tensor | None = None,
           lora: LoRAGroup | None = None, silu_out: bool = False) -> torch.Tensor:
    """``x @ weight.T + bias``: the fastest of cuBLAS and the skinny kernel's tile candidates
    for this shape; written into ``out`` when given. ``scale``: the per-row scales of an FP8
    ``weight``. Its few-row path is weight-only (the skinny kernel's FP8 variant against
    dequantize + cuBLAS: activations are never quantized, so a request's numerics do not
    depend on how many rows share its step up to ``skinny.MAX_M``); above that
    ``fp8_linear.matmul`` (W8A8 or dequantize + cuBLAS).

    The choice is measured on the first call of a shape outside graph capture (graph capture
    warms up eagerly first, so every captured shape is decided before its capture) and kept.
    ``lora``: the adapters (module docstring). ``silu_out``: ``weight`` is ``[gate | up]``
    and the result is ``silu_and_mul`` of the projection: in a whole-K skinny tile's
    epilogue (``skinny.skinny_linear(silu_pairs=True)``), else a launch after it.
    """
    assert not (silu_out and out is not None)
    if not _few_rows(x):
        delta = _shrink(lora, x)
        return _silu(_expand(_unfused_linear(x, weight, bias, out, scale), delta), silu_out)
    config = tuner.choose(
        (_kind("plain", weight), row_block(x.shape[0]), weight.shape[0], weight.shape[1], x.dtype,
         bias is not None),
        weight,
        unfused=lambda w: ref.linear(x, w, bias, out, scale=scale),
        fused=lambda cfg, w: skinny.skinny_linear(x, w, bias, config=cfg, out=out, scale=scale),
    )
    whole_k = skinny_lora.foldable(config)  # a whole-K tile: the epilogue can pair SiLU rows
    delta = _shrink(lora, x)
    if delta is not None and whole_k:
        return skinny_lora.lora_linear(x, weight, bias, delta, config, out=out, scale=scale,
                                       silu_pairs=silu_out)
    if silu_out and whole_k:
        return skinny.skinny_linear(x, weight, bias, config=config, scale=scale,
                                    silu_pairs=True)
    if config is not None:
        return _silu(_expand(skinny.skinny_linear(x, weight, bias, config=config, out=out,
                                                  scale=scale), delta), silu_out)
    return _silu(_expand(ref.linear(x, weight, bias, out, scale=scale), delta), silu_out)


def _silu(y: torch.Tensor, silu_out: bool) -> torch.Tensor:
    return silu_and_mul(y) if silu_out else y


def _unfused_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    out: torch.Tensor | None, scale: torch.Tensor | None) -> torch.Tensor:
    """cuBLAS: the plain GEMM, or for FP8 weights ``fp8_linear.matmul``."""
    if scale is None:
        return ref.linear(x, weight, bias, out)
    return fp8_linear.matmul(x, weight, scale, bias, out)


def _unfused_norm_linear(x: torch.Tensor, residual: torch.Tensor | None,
                         norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                         bias: torch.Tensor | None, scale: torch.Tensor | None = None,
                         lora: LoRAGroup | None = None, silu_out: bool = False,
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """``add_rms_norm`` then ``linear`` (which shrinks ``lora`` from the normed rows): two
    launches (one above ``MAX_M`` rows) besides the adapters'."""
    normed, new_res = add_rms_norm(x, residual, norm_weight, eps)
    return linear(normed, weight, bias, scale=scale, lora=lora, silu_out=silu_out), new_res


def norm_linear(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
    weight: torch.Tensor, bias: torch.Tensor | None = None, scale: torch.Tensor | None = None,
    lora: LoRAGroup | None = None, silu_out: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``add_rms_norm`` then ``linear``; returns ``(projection, new_residual)``. At a few
    rows one kernel does both when the measured choice says so. ``lora``: the adapters
    (module docstring). ``silu_out``: as for :func:`linear`."""
    if _few_rows(x):
        key = (_kind("norm" if residual is not None else "norm0", weight), row_block(x.shape[0]),
               weight.shape[0], weight.shape[1], x.dtype, bias is not None)
        config = tuner.choose(
            key, weight,
            unfused=lambda w: _unfused_norm_linear(x, residual, norm_weight, eps, w, bias,
                                                   scale),
            fused=lambda cfg, w: skinny.skinny_norm_linear(x, residual, norm_weight, eps, w,
                                                           bias, config=cfg, scale=scale))
        if config is not None:
            pairs = silu_out and skinny_lora.foldable(config)  # whole-K: the epilogue pairs
            delta = _shrink(lora, x, norm_weight=norm_weight, eps=eps, residual=residual)
            if delta is not None and skinny_lora.foldable(config):
                return skinny_lora.lora_norm_linear(x, residual, norm_weight, eps, weight, bias,
                                                    delta, config, scale=scale,
                                                    silu_pairs=pairs)
            y, new_res = skinny.skinny_norm_linear(x, residual, norm_weight, eps, weight, bias,
                                                   config=config, scale=scale, silu_pairs=pairs)
            return _silu(_expand(y, delta), silu_out and not pairs), new_res
    return _unfused_norm_linear(x, residual, norm_weight, eps, weight, bias, scale, lora,
                                silu_out)


def silu_linear(gate_up: torch.Tensor, weight: torch.Tensor,
                scale: torch.Tensor | None = None) -> torch.Tensor:
    """``silu_and_mul`` then ``linear`` (no bias); one kernel at a few rows when faster."""

    def unfused(w: torch.Tensor = weight):
        return linear(silu_and_mul(gate_up), w, scale=scale)

    if _few_rows(gate_up):
        key = (_kind("silu", weight), row_block(gate_up.shape[0]), weight.shape[0], weight.shape[1],
               gate_up.dtype, False)
        config = tuner.choose(
            key, weight, unfused,
            lambda cfg, w: skinny.skinny_silu_linear(gate_up, w, config=cfg, scale=scale))
        if config is not None:
            return skinny.skinny_silu_linear(gate_up, weight, config=config, scale=scale)
    return unfused()
