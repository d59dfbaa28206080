"""FP8-weight projections above the skinny kernel's rows: W8A8 or dequantize + cuBLAS.

A weight quantized to ``float8_e4m3fn`` with one float32 scale per output row
(``ref.quantize_fp8``) is multiplied by many rows in one of two ways:

* **W8A8** (:func:`w8a8_linear`): each input row is quantized to e4m3 with its own scale
  (``amax / 448``, computed on the fly: dynamic per-token; one Triton launch,
  :func:`quantize_rows`), and ``torch._scaled_mm`` runs the FP8 tensor-core GEMM with
  row-wise scales (token scales × channel scales) and a bf16 output. Reads one byte per
  weight and does twice the bf16 tensor-core rate.
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
import triton
import triton.language as tl

from replaylm.env import triton_interpreted
from replaylm.kernels import pdl, ref
from replaylm.kernels.pdl import wait_for_previous
from replaylm.kernels.ref import FP8_DTYPE, FP8_MAX, MIN_ROW_SCALE

_E4M3_MAX = tl.constexpr(FP8_MAX)
_MIN_SCALE = tl.constexpr(MIN_ROW_SCALE)


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


@triton.jit
def _round_to_e4m3(y):
    """``y`` (float32, within ±448) rounded to the nearest e4m3 value, ties to even, still
    as float32: adding and taking away ``1.5 · 2^(e + 20)`` leaves ``y`` on the grid of
    spacing ``2^(e - 3)``, e4m3's at ``y``'s exponent ``e`` (``2^-9`` for its subnormals,
    below ``2^-6``). The cast to e4m3 that follows is then exact on every backend, the
    Triton interpreter included (whose own rounding mis-carries into the exponent)."""
    exponent = tl.maximum((y.to(tl.int32, bitcast=True) >> 23) & 0xFF, 127 - 6)
    magic = (((exponent + 20) << 23) | 0x400000).to(tl.float32, bitcast=True)
    return (y + magic) - magic


@triton.jit(do_not_specialize=["num_rows"])
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, num_rows, stride_x, stride_q,
                          K: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """One program per row: its absolute maximum, then every element divided by
    ``max(amax / 448, MIN_ROW_SCALE)`` and rounded to e4m3 (as ``ref.quantize_rows``)."""
    wait_for_previous(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_ptr + row * stride_x + k0 + cols, mask=k0 + cols < K, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), _E4M3_MAX), _MIN_SCALE)
    tl.store(scale_ptr + row, scale)
    for k0 in range(0, K, BLOCK):
        mask = k0 + cols < K
        x = tl.load(x_ptr + row * stride_x + k0 + cols, mask=mask, other=0.0)
        y = tl.minimum(tl.maximum(tl.math.div_rn(x.to(tl.float32), scale), -_E4M3_MAX),
                       _E4M3_MAX)
        tl.store(q_ptr + row * stride_q + k0 + cols, _round_to_e4m3(y).to(q_ptr.dtype.element_ty),
                 mask=mask)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token quantization (``ref.quantize_rows``): ``x`` ``[M, K]`` as e4m3 with
    one float32 scale per row (``[M, 1]``); one launch on CUDA or in the interpreter, the
    same bits as the torch reference."""
    if not (x.is_cuda or triton_interpreted()):
        return ref.quantize_rows(x)
    num_rows, k = x.shape
    assert x.stride(-1) == 1
    q = torch.empty(num_rows, k, device=x.device, dtype=FP8_DTYPE)
    scale = torch.empty(num_rows, 1, device=x.device, dtype=torch.float32)
    if num_rows:
        _quantize_rows_kernel[(num_rows,)](
            x, q, scale, num_rows, x.stride(0), q.stride(0), K=k,
            BLOCK=min(4096, triton.next_power_of_2(k)), USE_PDL=pdl.ENABLED, num_warps=8,
            **pdl.LAUNCH)
    return q, scale


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
