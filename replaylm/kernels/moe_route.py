"""The MoE layer's two small kernels around the experts (``kernels.moe_decode`` and
``kernels.moe`` run the experts themselves):

* :func:`route_topk` — one launch, one program per token: softmax over the ``E`` router
  logits in fp32, the ``k`` largest probabilities by repeated arg-max (ties go to the lower
  expert id), optional renormalisation (``ref.route_topk``).
* :func:`shared_combine` — ``routed + sigmoid(x @ gate_w^T) * shared`` in one launch (the
  shared expert's gate is a single dot product per token, computed in the same program).

Both launch shapes depend only on ``T`` and the model's shapes, so a capture at a tier serves
any routing with no host sync; under PDL each waits for the kernel before it
(``pdl.wait_for_previous``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replaylm.kernels import pdl
from replaylm.kernels.pdl import wait_for_previous


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, stride_l, E: tl.constexpr,
                  TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_TOP: tl.constexpr,
                  NORMALIZE: tl.constexpr, USE_PDL: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    wait_for_previous(USE_PDL)
    offs = tl.arange(0, BLOCK_E)
    valid = offs < E
    logits = tl.load(logits_ptr + t * stride_l + offs, mask=valid,
                     other=-float("inf")).to(tl.float32)
    p = tl.exp(logits - tl.max(logits, axis=0))
    probs = p / tl.sum(p, axis=0)
    # Probabilities are >= 0: -1 marks lanes past E, -2 the experts already taken.
    remaining = tl.where(valid, probs, -1.0)
    slots = tl.arange(0, BLOCK_TOP)
    top_w = tl.zeros((BLOCK_TOP,), dtype=tl.float32)
    top_i = tl.zeros((BLOCK_TOP,), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        w, i = tl.max(remaining, axis=0, return_indices=True)  # ties: the lower id
        # A NaN row (a padded token) may pick any lane: keep the id a real expert's.
        i = tl.minimum(i, E - 1)
        top_w = tl.where(slots == j, w, top_w)
        top_i = tl.where(slots == j, i, top_i)
        remaining = tl.where(offs == i, -2.0, remaining)
    if NORMALIZE:
        top_w = top_w / tl.sum(top_w, axis=0)
    out = slots < TOP_K
    tl.store(weights_ptr + t * TOP_K + slots, top_w.to(weights_ptr.dtype.element_ty), mask=out)
    tl.store(ids_ptr + t * TOP_K + slots, top_i.to(ids_ptr.dtype.element_ty), mask=out)


def route_topk(router_logits: torch.Tensor, top_k: int, normalize: bool,
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``ref.route_topk`` in one launch: ``(weights, ids)`` ``[T, top_k]``, the weights in
    the logits' dtype, the ids int64; tied probabilities go to the lower expert id."""
    t, e = router_logits.shape
    if not 0 < top_k <= e:
        raise ValueError(f"route_topk: top_k={top_k} must be in 1..{e} (the number of experts)")
    weights = torch.empty(t, top_k, dtype=router_logits.dtype, device=router_logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=router_logits.device)
    if t == 0:
        return weights, ids
    if router_logits.stride(1) != 1:
        router_logits = router_logits.contiguous()
    block_e = triton.next_power_of_2(e)
    _route_kernel[(t,)](
        router_logits, weights, ids, router_logits.stride(0), E=e, TOP_K=top_k,
        BLOCK_E=block_e, BLOCK_TOP=triton.next_power_of_2(top_k), NORMALIZE=normalize,
        USE_PDL=pdl.ENABLED, num_warps=1 if block_e <= 256 else 4, **pdl.LAUNCH)
    return weights, ids


@triton.jit
def _combine_kernel(routed_ptr, shared_ptr, x_ptr, gate_w_ptr, out_ptr, H: tl.constexpr,
                    BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < H
    gate_w = tl.load(gate_w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    wait_for_previous(USE_PDL)
    x = tl.load(x_ptr + t * H + offs, mask=mask, other=0.0)
    dt = x.dtype
    gate = tl.sum(x.to(tl.float32) * gate_w, axis=0).to(dt).to(tl.float32)
    scale = (1.0 / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
    shared = tl.load(shared_ptr + t * H + offs, mask=mask, other=0.0).to(tl.float32)
    routed = tl.load(routed_ptr + t * H + offs, mask=mask, other=0.0).to(tl.float32)
    gated = (scale * shared).to(dt).to(tl.float32)
    tl.store(out_ptr + t * H + offs, (routed + gated).to(dt), mask=mask)


def shared_combine(routed: torch.Tensor, shared: torch.Tensor, x: torch.Tensor,
                   gate_weight: torch.Tensor) -> torch.Tensor:
    """``ref.shared_combine``: ``routed + sigmoid(x @ gate_weight^T) * shared`` (``[T, H]``
    each, ``gate_weight`` ``[1, H]``), one program per token."""
    t, h = x.shape
    out = torch.empty_like(routed)
    if t == 0:
        return out
    routed, shared, x = routed.contiguous(), shared.contiguous(), x.contiguous()
    block_h = triton.next_power_of_2(h)
    _combine_kernel[(t,)](routed, shared, x, gate_weight.contiguous(), out, H=h,
                          BLOCK_H=block_h, USE_PDL=pdl.ENABLED,
                          num_warps=4 if block_h <= 4096 else 8, **pdl.LAUNCH)
    return out
