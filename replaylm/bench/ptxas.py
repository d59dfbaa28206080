"""Registers, spills and shared memory of a model's batch-1 decode kernels, without a GPU.

    python -m replaylm.bench.ptxas [--model qwen3-0.6b] [--arch 90]

Triton compiles a kernel variant for a target GPU on any machine, and the ``ptxas`` it ships
reports what the variant uses per thread and per program. From those figures and the SM's
limits (65,536 registers, 228 KB shared memory, 64 warps, 32 programs) follows how many
programs of the variant fit on one SM. So a kernel edit's resource cost can be checked before
spending device time. Session 6's 4-wide split merge is an example: it raised decode
attention from 128 to 168 registers per thread, 3 programs per SM instead of 4, and then
measured 8% slower at batch 2.

The variants are the ones a batch-1 decode step launches: attention with the tile
``pick_config`` gives a decode launch, doing the rotary work itself (the default at batch
1; with ``REPLAYLM_ROPE_IN_ATTENTION=0`` the rotary kernel's row follows), and the four
projections.
Projections take the tile from the tuning cache (``$REPLAYLM_CACHE/linear_tuning.json``,
written on the GPU, entries for the current kernel sources) when it holds the shape, else
``gemv.pick_config``'s default. Where the cache says a fused prologue lost, the row is the
plain projection that then runs after the separate op; shapes it sends to cuBLAS are listed
as such. Pointers and strides are taken as 16-aligned, as at
the engine's launches.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Per-SM limits of Hopper (sm_90): registers, shared memory (bytes), warps, programs.
SM_REGISTERS, SM_SHARED, SM_WARPS, SM_PROGRAMS = 65536, 228 * 1024, 64, 32
#: Shared memory the driver reserves per program (bytes).
RESERVED_SHARED = 1024


@dataclass(frozen=True)
class Variant:
    """One compiled form of a kernel: its constexprs and launch options. Pointer arguments
    are bf16 unless ``pointers`` says otherwise; other arguments are 32-bit ints (16-aligned
    unless listed in ``unaligned``) or, when in ``floats``, fp32."""

    label: str
    kernel: Any  # a triton.JITFunction
    constexprs: dict[str, Any]
    num_warps: int
    num_stages: int = 1
    pointers: dict[str, str] = field(default_factory=dict)
    floats: tuple[str, ...] = ()
    unaligned: tuple[str, ...] = ()


@dataclass(frozen=True)
class Usage:
    registers: int  # per thread
    spill_bytes: int  # spill stores + loads per thread
    shared_bytes: int  # per program
    programs_per_sm: int


def parse_ptxas(text: str) -> tuple[int, int]:
    """(registers per thread, spill store + load bytes) from ``ptxas -v`` output."""
    regs = re.search(r"Used (\d+) registers", text)
    if regs is None:
        raise ValueError(f"no register count in ptxas output: {text[:300]!r}")
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return int(regs.group(1)), (int(spills.group(1)) + int(spills.group(2)) if spills else 0)


def programs_per_sm(registers: int, shared_bytes: int, num_warps: int) -> int:
    """Programs of one variant resident on an SM at once, from its registers per thread
    (allocated per warp in units of 256), its shared memory and its warps."""
    per_warp = -(-registers * 32 // 256) * 256
    by_regs = (SM_REGISTERS // per_warp) // num_warps if per_warp else SM_PROGRAMS
    by_shared = SM_SHARED // (shared_bytes + RESERVED_SHARED)
    return max(0, min(by_regs, by_shared, SM_WARPS // num_warps, SM_PROGRAMS))


def _ptxas() -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas")


def ptx(v: Variant, arch: int = 90) -> str:
    """The PTX Triton emits for ``v`` on ``sm_{arch}a``."""
    return _compile(v, arch).asm["ptx"]


def usage(v: Variant, arch: int = 90) -> Usage:
    """Compile ``v`` for ``sm_{arch}a`` and read its resource use back from ptxas."""
    compiled = _compile(v, arch)
    with tempfile.TemporaryDirectory() as tmp:
        ptx_file = Path(tmp) / "kernel.ptx"
        ptx_file.write_text(compiled.asm["ptx"])
        out = subprocess.run([_ptxas(), f"-arch=sm_{arch}a", "-v", str(ptx_file), "-o",
                              str(Path(tmp) / "kernel.cubin")],
                             capture_output=True, text=True, check=True)
    regs, spills = parse_ptxas(out.stderr + out.stdout)
    shared = int(compiled.metadata.shared)
    return Usage(regs, spills, shared, programs_per_sm(regs, shared, v.num_warps))


def _compile(v: Variant, arch: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if not hasattr(v.kernel, "cache_key"):  # an InterpretedFunction
        raise RuntimeError("the kernels were decorated under TRITON_INTERPRET=1, which cannot "
                           "compile them: run without it")
    names = list(v.kernel.arg_names)
    sig: dict[str, str] = {}
    attrs: dict[tuple[int], list] = {}
    for i, name in enumerate(names):
        if name in v.constexprs:
            sig[name] = "constexpr"
            continue
        if name.endswith("_ptr"):
            sig[name] = v.pointers.get(name, "*bf16")
        else:
            sig[name] = "fp32" if name in v.floats else "i32"
        if sig[name] != "fp32" and name not in v.unaligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=v.kernel, signature=sig, attrs=attrs,
                    constexprs={(names.index(k),): c for k, c in v.constexprs.items()})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": v.num_warps, "num_stages": v.num_stages})


def decode_variants(model: str) -> list[Variant | str]:
    """The variants of ``model``'s batch-1 decode step (a string where cuBLAS runs)."""
    import torch
    import triton

    from replaylm.engine.model_runner import DEFAULT_GPU_GRAPH_MODE
    from replaylm.kernels import attention, fused, gemv
    from replaylm.model.llama import rope_in_attention_limit
    from replaylm.model.shapes import NAMED_SHAPES

    shape = NAMED_SHAPES[model]
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    hq, hkv = shape["num_attention_heads"], shape["num_key_value_heads"]
    d = shape.get("head_dim", hidden // hq)
    qk_norm = shape["model_type"] == "qwen3"
    g_pad = attention.group_pad(hq, hkv)
    cfg = attention.pick_config(1, g_pad, d, latency_bound=True)
    min_split = triton.cdiv(cfg.min_split_keys, cfg.block_n) * cfg.block_n
    rope = rope_in_attention_limit(DEFAULT_GPU_GRAPH_MODE) >= 1  # at batch 1
    variants: list[Variant | str] = [Variant(
        f"attention{' + rotary' if rope else ','} decode tile {cfg.block_m}x{cfg.block_n}, "
        "split-KV", attention._paged_attn_kernel,
        dict(GROUP=hq // hkv, G_PAD=g_pad, BQ=cfg.block_m // g_pad, BLOCK_N=cfg.block_n,
             HEAD_DIM=d, PAGE=16, IS_SPLIT=True, MIN_SPLIT=min_split, ROPE=rope,
             HAS_QK_NORM=rope and qk_norm, CHUNK=attention._SEARCH_CHUNK, USE_PDL=True),
        cfg.num_warps, cfg.num_stages,
        pointers={"part_o_ptr": "*fp32", "part_ml_ptr": "*fp32", "counter_ptr": "*i32",
                  "cu_q_ptr": "*i32", "kv_lens_ptr": "*i32", "block_table_ptr": "*i32",
                  "pos_ptr": "*i64", "cs_ptr": "*fp32", "slot_ptr": "*i64"},
        floats=("eps", "sm_scale_log2"),
        unaligned=("num_tokens", "num_reqs", "num_splits", "stride_bt"),
    )]
    if not rope:
        variants.append(Variant(
            "rotary (+ q/k norm, KV write), a head per program", fused._rotary_kernel,
            dict(HQ=hq, HKV=hkv, HP=1, HALF=d // 2, HAS_NORM=qk_norm, WRITE_KV=True, PAGE=16,
                 USE_PDL=True),
            max(1, min(4, d // 256)),
            pointers={"pos_ptr": "*i64", "cs_ptr": "*fp32", "slot_ptr": "*i64"},
            floats=("eps",), unaligned=("num_tokens",),
        ))
    tuned = gemv._TuningCache().decisions_by_shape()  # read now: REPLAYLM_CACHE may change

    def shape_key(kind: str, n: int, k: int) -> str:
        return gemv._TuningCache.shape_key((kind, 1, n, k, torch.bfloat16, False))

    projections = (("qkv", "norm", gemv.PROLOGUE_NORM, (hq + 2 * hkv) * d, hidden),
                   ("o_proj", "plain", gemv.PROLOGUE_PLAIN, hidden, hq * d),
                   ("gate_up", "norm", gemv.PROLOGUE_NORM, 2 * inter, hidden),
                   ("down", "silu", gemv.PROLOGUE_SILU, hidden, inter))
    separate = {"norm": "after a separate RMSNorm", "silu": "after a separate SiLU·mul"}
    for name, kind, prologue, n, k in projections:
        key = shape_key(kind, n, k)
        note = "tuned" if key in tuned else "default"
        if key in tuned and tuned[key] is None and kind != "plain":
            # The fusion lost: the separate op, then ``linear``'s own choice for the shape.
            kind, prologue, note = "plain", gemv.PROLOGUE_PLAIN, separate[kind]
            key = shape_key("plain", n, k)
        if key in tuned and tuned[key] is None:
            variants.append(f"{name} {n}x{k}: cuBLAS (tuning cache)")
            continue
        bm, bn, bk, warps = tuned.get(key) or gemv.pick_config(1, n, k)
        chunks = triton.cdiv(k, bk)
        variants.append(Variant(
            f"{name} {n}x{k}, tile {bn}x{bk} ({note})", gemv._skinny_kernel,
            dict(M=1, K=k, PROLOGUE=prologue, HAS_RESIDUAL=kind == "norm", HAS_BIAS=False,
                 BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EVEN_N=n % bn == 0, EVEN_K=k % bk == 0,
                 CHUNKS=chunks, WHOLE=chunks <= gemv.MAX_UNROLL, USE_PDL=True, ROPE=False,
                 HQ=1, HKV=1, HEAD_DIM=2, PAGE=16, HAS_QK_NORM=False),
            warps,
            pointers={"counter_ptr": "*i32", "pos_ptr": "*i64", "slot_ptr": "*i64",
                      "cs_ptr": "*fp32"},
            floats=("eps", "rope_eps"),
        ))
    return variants


def main(argv: list[str] | None = None) -> int:
    from replaylm.model.shapes import NAMED_SHAPES

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-0.6b", choices=sorted(NAMED_SHAPES))
    ap.add_argument("--arch", type=int, default=90, help="compute capability x10 (90: H100/H200)")
    ns = ap.parse_args(argv)
    print(f"{'kernel variant':64s} {'regs':>5s} {'spill B':>8s} {'smem B':>8s} {'per SM':>6s}")
    for v in decode_variants(ns.model):
        if isinstance(v, str):
            print(v)
            continue
        u = usage(v, ns.arch)
        print(f"{v.label:64s} {u.registers:5d} {u.spill_bytes:8d} {u.shared_bytes:8d} "
              f"{u.programs_per_sm:6d}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
