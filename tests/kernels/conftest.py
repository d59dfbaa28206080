"""Triton kernels vs their torch references, on CPU through the Triton interpreter (fp32): the
setup shared by every module in ``tests/kernels``.

Triton picks the interpreter when ``triton`` itself is imported (``tl.sum`` & co. are jitted
then) and when each kernel is decorated, so ``TRITON_INTERPRET=1`` must be set before the
first ``import triton``. This conftest (loaded before any module of this folder is imported)
sets it when Triton is not imported yet, on a machine without CUDA (importing torch first is
fine: torch does not import Triton). If Triton was already imported without the interpreter
(a module collected earlier got there first, or a CUDA machine, where the GPU tests need
compiled kernels), the tests here skip and ``test_interpreter.py`` reruns this folder in a
fresh interpreter-mode subprocess instead.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import SimpleNamespace

import pytest
import torch

from tests.kernels.helpers import CHILD_FLAG, interpreter_active

if "triton" not in sys.modules and (os.environ.get(CHILD_FLAG) or not torch.cuda.is_available()):
    os.environ["TRITON_INTERPRET"] = "1"


# Dependencies first: a module that imports another's kernels by name is reloaded after it.
_MODULES = ("replaylm.kernels.pdl", "replaylm.kernels.dot", "replaylm.kernels.rope",
            "replaylm.kernels.attention_kernel",
            "replaylm.kernels.attention", "replaylm.kernels.kv_write",
            "replaylm.kernels.elementwise", "replaylm.kernels.fp8_linear",
            "replaylm.kernels.skinny_split",
            "replaylm.kernels.skinny", "replaylm.kernels.tuner",
            "replaylm.kernels.lora_grouped", "replaylm.kernels.lora",
            "replaylm.kernels.skinny_lora",
            "replaylm.kernels.moe_align", "replaylm.kernels.moe",
            "replaylm.kernels.moe_decode", "replaylm.kernels.moe_route",
            "replaylm.kernels.ops",
            "replaylm.kernels.argmax", "replaylm.kernels.sample", "replaylm.kernels.step_inputs")


def _compiled_kernels(mod) -> bool:
    """Whether ``mod`` holds kernels decorated before the interpreter was on."""
    from triton.runtime.jit import JITFunction

    return any(isinstance(v, JITFunction) for v in vars(mod).values())


def _index_shim():
    """Triton 3.6's interpreter turns a scalar into ``int(array_of_shape_1)``, which numpy
    >= 2.4 refuses, so kernels with runtime loop bounds fail; patch in a 0-d conversion.
    Returns an undo callable."""
    from triton.runtime import interpreter

    orig = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
    return lambda: setattr(interpreter, "_patch_lang_tensor", orig)


@pytest.fixture(scope="module")
def kernels():
    if not interpreter_active():
        pytest.skip("Triton was imported without the interpreter; see test_interpreter.py")
    undo_shim = _index_shim()
    mods = [importlib.import_module(name) for name in _MODULES]
    if any(map(_compiled_kernels, mods)):  # imported before the interpreter: redecorate
        mods = [importlib.reload(mod) for mod in mods]
    from replaylm.attention.triton_backend import TritonAttentionBackend

    by_name = {m.__name__.rsplit(".", 1)[1]: m for m in mods}
    yield SimpleNamespace(attn=by_name["attention"], kvw=by_name["kv_write"],
                          skinny=by_name["skinny"], skinny_split=by_name["skinny_split"],
                          elementwise=by_name["elementwise"], fp8_linear=by_name["fp8_linear"],
                          ops=by_name["ops"], tuner=by_name["tuner"], argmax=by_name["argmax"],
                          step_inputs=by_name["step_inputs"], moe=by_name["moe"],
                          moe_align=by_name["moe_align"],
                          moe_decode=by_name["moe_decode"], moe_route=by_name["moe_route"],
                          lora=by_name["lora"], lora_grouped=by_name["lora_grouped"],
                          skinny_lora=by_name["skinny_lora"],
                          sample=by_name["sample"],
                          backend=TritonAttentionBackend())
    undo_shim()
