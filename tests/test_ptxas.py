"""The no-GPU resource report (``replaylm.bench.ptxas``): parsing, occupancy arithmetic, and
compiling a real decode step's variants for sm_90a on the CPU (which also catches a kernel
signature the report no longer matches)."""

from __future__ import annotations

import pytest

from replaylm.bench import ptxas

PTXAS_OUT = """ptxas info    : Compiling entry function '_paged_attn_kernel' for 'sm_90a'
ptxas info    : Function properties for _paged_attn_kernel
    16 bytes stack frame, 20 bytes spill stores, 24 bytes spill loads
ptxas info    : Used 128 registers, used 1 barriers, 16 bytes cumulative stack size
"""


def test_parse_ptxas():
    assert ptxas.parse_ptxas(PTXAS_OUT) == (128, 44)
    assert ptxas.parse_ptxas("ptxas info    : Used 26 registers") == (26, 0)
    with pytest.raises(ValueError, match="register"):
        ptxas.parse_ptxas("nothing here")


def test_programs_per_sm():
    # 128 registers x 4 warps: the register file holds 4 programs.
    assert ptxas.programs_per_sm(128, 22528, 4) == 4
    # 168 registers round up to 5,376 per warp: 12 warps, 3 programs.
    assert ptxas.programs_per_sm(168, 22528, 4) == 3
    # Tiny programs are capped by the 32-program limit, 8-warp ones by 64 warps.
    assert ptxas.programs_per_sm(26, 0, 1) == 32
    assert ptxas.programs_per_sm(24, 0, 8) == 8
    # Shared memory: 100 KB programs, two per SM.
    assert ptxas.programs_per_sm(32, 100 * 1024, 4) == 2


def test_cli_compiles_a_decode_step_and_reports(tmp_path):
    """The CLI end to end, in a subprocess: the kernels must be compiled, not interpreted
    (``tests/test_kernels.py`` may have switched this process to the interpreter)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "REPLAYLM_ROPE_IN_ATTENTION")}
    env["REPLAYLM_CACHE"] = str(tmp_path)  # no tuning cache: default tiles
    out = subprocess.run([sys.executable, "-m", "replaylm.bench.ptxas", "--model", "qwen3-0.6b"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = out.stdout.splitlines()[1:]
    # Batch 1 does the rotary work inside attention by default: no rotary kernel.
    assert [r.split()[0] for r in rows] == ["attention", "qkv", "o_proj", "gate_up", "down"]
    assert rows[0].startswith("attention + rotary")
    for row in rows:
        regs, spill, smem, per_sm = (int(x) for x in row.split()[-4:])
        assert 0 < regs <= 255 and spill >= 0 and smem >= 0 and per_sm >= 1, row


_TRIGGER_ORDER = """
from replaylm.bench import ptxas
qkv = next(v for v in ptxas.decode_variants("qwen3-0.6b") if v.label.startswith("qkv"))
code = ptxas.ptx(qkv)
print(code.index("griddepcontrol.launch_dependents") < code.index("griddepcontrol.wait"))
"""


@pytest.mark.parametrize("early", ["1", "0"])
def test_pdl_trigger_sits_where_the_mode_says(tmp_path, early):
    """The compiled kernel lets its successor launch before its own wait (the default) or
    after it (``REPLAYLM_PDL_EARLY=0``, which also keeps its own tuned tiles)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"REPLAYLM_CACHE": str(tmp_path), "REPLAYLM_PDL_EARLY": early}
    out = subprocess.run([sys.executable, "-c", _TRIGGER_ORDER], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == [str(early == "1")]


def test_projection_tiles_come_from_the_tuning_cache(monkeypatch, tmp_path):
    import json

    from replaylm.kernels.gemv import _kernels_revision

    prefix = f"NVIDIA H200|torch 2.11|triton 3.6.0|pdl True|src {_kernels_revision()}|"
    stale = "NVIDIA H200|torch 2.11|triton 3.6.0|pdl True|src 000000000000|"
    (tmp_path / "linear_tuning.json").write_text(json.dumps({
        prefix + "norm|1x4096x1024|torch.bfloat16|False": [[1, 8, 256, 4], 3.5, 5.2],
        prefix + "silu|1x1024x3072|torch.bfloat16|False": [None, 4.4, 4.4],
        prefix + "plain|1x1024x3072|torch.bfloat16|False": [None, 6.7, 6.7],
        prefix + "norm|1x6144x1024|torch.bfloat16|False": [None, 6.8, 6.8],
        prefix + "plain|1x6144x1024|torch.bfloat16|False": [[1, 8, 256, 4], 5.0, 6.1],
        stale + "plain|1x1024x2048|torch.bfloat16|False": [[1, 16, 128, 4], 2.0, 9.0],
    }))
    monkeypatch.setenv("REPLAYLM_CACHE", str(tmp_path))
    monkeypatch.delenv("REPLAYLM_ROPE_IN_ATTENTION", raising=False)
    variants = ptxas.decode_variants("qwen3-0.6b")
    qkv = variants[1]
    assert qkv.label == "qkv 4096x1024, tile 8x256 (tuned)"
    assert (qkv.constexprs["BLOCK_N"], qkv.constexprs["BLOCK_K"], qkv.num_warps) == (8, 256, 4)
    assert variants[2].label.endswith("(default)")  # the stale entry is not used
    gate_up = variants[3]
    assert gate_up.label == "gate_up 6144x1024, tile 8x256 (after a separate RMSNorm)"
    assert gate_up.constexprs["PROLOGUE"] == 0 and not gate_up.constexprs["HAS_RESIDUAL"]
    # Fused SiLU lost, and so did the plain skinny kernel: cuBLAS.
    assert variants[-1] == "down 1024x3072: cuBLAS (tuning cache)"
