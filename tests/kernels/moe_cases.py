"""Random routed-expert problems for the MoE kernel tests (fp32, CPU)."""

from __future__ import annotations

import torch

from replaylm.kernels import ref


def moe_case(t: int, e: int, k: int, h: int, i: int, seed: int,
             bias: torch.Tensor | None = None, normalize: bool = False):
    """``(x, w_gate_up, w_down, topk_weights, topk_ids)`` for ``t`` tokens over ``e`` experts
    (top ``k``, hidden ``h``, expert FFN ``i``); ``bias`` is added to the router logits per
    expert (steering tokens towards some experts or away from others)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    logits = torch.randn(t, e, generator=g)
    if bias is not None:
        logits = logits + bias
    w_gate_up = torch.randn(e, 2 * i, h, generator=g) * 0.1
    w_down = torch.randn(e, h, i, generator=g) * 0.1
    weights, ids = ref.route_topk(logits, k, normalize=normalize)
    return x, w_gate_up, w_down, weights, ids


def fp8_moe_case(t: int, seed: int):
    """A small routed-expert problem with FP8 experts (6 experts, top 2, hidden 32, FFN 16):
    ``(x, gate_up, down, topk_weights, topk_ids, gate_up_scale, down_scale)`` and the
    reference's result."""
    e, k, h, i = 6, 2, 32, 16
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    gate_up, gate_up_scale = ref.quantize_fp8(torch.randn(e, 2 * i, h, generator=g))
    down, down_scale = ref.quantize_fp8(torch.randn(e, h, i, generator=g))
    weights, ids = ref.route_topk(torch.randn(t, e, generator=g), k, True)
    args = (x, gate_up, down, weights, ids, gate_up_scale, down_scale)
    return args, ref.fused_moe(*args)

