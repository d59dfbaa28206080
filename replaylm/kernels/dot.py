"""Matrix products at the precision of their inputs.

On NVIDIA GPUs ``tl.dot`` multiplies float32 operands as TF32 unless told otherwise (10
mantissa bits: a relative error near 1e-3, enough to flip a near tie between two logits).
Every replaylm kernel multiplies through :func:`dot`, which asks for IEEE float32 when the
operands are float32 (the branch is resolved at compile time from the operand dtype, so each
specialization holds one ``tt.dot``); bf16 and fp16 operands take ``tl.dot``'s default
(their products are exact in the float32 accumulator).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dot(a, b):
    """``a @ b`` accumulated in float32; float32 operands multiply in IEEE float32."""
    if a.dtype == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)
