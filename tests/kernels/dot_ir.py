"""Prints, as JSON, the ``tt.dot`` operations of every replaylm kernel that multiplies
matrices, lowered to Triton IR for an sm_90 target in float32 and in bf16. Run as a module in
a process where Triton is compiled-mode (``test_dot_precision.py`` does): lowering to Triton IR
needs no GPU."""

from __future__ import annotations

import json
import re

from triton._C.libtriton import ir
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend

from replaylm.kernels import attention_kernel, moe

#: Pointer arguments that hold indices, not activations or weights.
INDEX_POINTERS = {"counter_ptr", "cu_q_ptr", "kv_lens_ptr", "block_table_ptr", "pos_ptr",
                  "slot_ptr", "slot_rows_ptr", "tile_expert_ptr"}
SCALARS = {"eps", "sm_scale_log2"}
ATTN = dict(GROUP=4, G_PAD=4, BQ=16, BLOCK_N=64, HEAD_DIM=128, PAGE=16, MIN_SPLIT=256,
            CHUNK=128, USE_PDL=False)
MOE = dict(H=64, INTER=64, BLOCK_M=16, BLOCK_N=32, BLOCK_K=32)
KERNELS = {
    "attention": (attention_kernel._paged_attn_kernel,
                  dict(ATTN, IS_SPLIT=False, ROPE=False, HAS_QK_NORM=False)),
    "attention_split_rope": (attention_kernel._paged_attn_kernel,
                             dict(ATTN, IS_SPLIT=True, ROPE=True, HAS_QK_NORM=True)),
    "moe_gate_up": (moe._gate_up_kernel, dict(MOE, TOP_K=2)),
    "moe_down": (moe._down_kernel, MOE),
}


def signature(fn, dtype: str, constexprs: dict) -> dict[str, str]:
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in INDEX_POINTERS:
            sig[name] = "*i32"
        elif name.endswith("_ptr"):
            sig[name] = "*" + dtype
        else:
            sig[name] = "fp32" if name in SCALARS else "i32"
    return sig


def dots(fn, dtype: str, constexprs: dict) -> list[str]:
    """The ``tt.dot`` lines of ``fn``'s Triton IR for one specialization."""
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    options = backend.parse_options({})
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    src = ASTSource(fn, signature=signature(fn, dtype, constexprs), constexprs=constexprs)
    module = src.make_ir(target, options, backend.get_codegen_implementation(options),
                         backend.get_module_map(), context)
    return re.findall(r"tt\.dot [^\n]*", str(module))


def main() -> None:
    print(json.dumps({f"{name}/{dtype}": dots(fn, dtype, ce)
                      for name, (fn, ce) in KERNELS.items() for dtype in ("fp32", "bf16")}))


if __name__ == "__main__":
    main()
