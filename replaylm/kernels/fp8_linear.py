"""FP8-weight projections above the skinny kernel's rows: W8A8 or dequantize + cuBLAS.

A weight quantized to ``float8_e4m3fn`` with one float32 scale per output row
(``ref.quantize_fp8``) is multiplied by many rows in one of two ways:

* **W8A8** (:func:`w8a8_linear`): each input row is quantized to e4m3 with its own scale
  (``amax / 448``, computed on the fly: dynamic per-token), and ``torch._scaled_mm`` runs
  the FP8 tensor-core GEMM with row-wise scales (token scales × channel scales) and a bf16
  output. Reads one byte per weight and does twice the bf16 tensor-core rate.
* **dequantize + cuBLAS** (``ref.linear`` with a scale): the weight is expanded to the
  activations' dtype and multiplied as a bf16 (or fp32) weight would be: exact to the
  dequantized weight, but reads the weight bytes three times (FP8 in, bf16 out, bf16 in).

:func:`matmul` picks by a fixed rule (:func:`w8a8_applies`): W8A8 wherever
``torch._scaled_mm`` can run it (a CUDA GPU of compute capability 8.9 or later, bf16
activations, ``K`` and ``N`` multiples of 16); dequantize + cuBLAS otherwise, which keeps
fp32 models fp32 (``_scaled_mm``'s row-wise scaling has only a bf16 output).
``benchmarks/fp8_gemm.py`` measures both (and bf16) per shape and row count.
"""

from __future__ import annotations

import functools

import torch

from replaylm.kernels import ref
from replaylm.kernels.ref import FP8_DTYPE, FP8_MAX

#: Smallest activation scale: a row of zeros quantizes to zeros instead of dividing by 0.
_MIN_SCALE = 1e-12


@functools.cache
def _device_has_fp8(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 9)


def w8a8_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`w8a8_linear` can run ``x @ weight.T``: ``torch._scaled_mm``'s FP8
    GEMM with row-wise scales needs an FP8-capable GPU, a bf16 output and dimensions that
    are multiples of 16."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and weight.dtype == FP8_DTYPE
            and x.shape[1] % 16 == 0 and weight.shape[0] % 16 == 0
            and _device_has_fp8(x.device.index if x.device.index is not None
                                else torch.cuda.current_device()))


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token quantization: ``x`` ``[M, K]`` as e4m3 with one float32 scale per
    row (``[M, 1]``, ``amax / 448``)."""
    xf = x.float()
    scale = (xf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(_MIN_SCALE)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def w8a8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
                ) -> torch.Tensor:
    """``x @ dequantize(weight).T + bias`` with ``x`` quantized per token: one
    ``torch._scaled_mm`` (bf16 out) after the activation quantization."""
    xq, x_scale = quantize_rows(x)
    y = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=scale[None, :],
                         bias=bias, out_dtype=x.dtype)
    if out is None:
        return y
    return out.copy_(y)


def matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
           bias: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequantize(weight, scale).T + bias`` for an FP8 ``weight``: W8A8 where
    :func:`w8a8_applies`, else dequantize + cuBLAS (``ref.linear``); into ``out`` when
    given."""
    if w8a8_applies(x, weight):
        return w8a8_linear(x, weight, scale, bias, out)
    return ref.linear(x, weight, bias, out, scale=scale)
