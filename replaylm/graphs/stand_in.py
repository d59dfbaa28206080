"""A CPU stand-in for ``torch.cuda.CUDAGraph`` that gives CI's graph tests teeth.

A real graph bakes in every address it touches and replays kernels without Python. The
stand-in re-runs the captured callable instead, but enforces what a real graph would make
silently wrong:

- every tensor the callable reads or writes through its static buffers must keep the
  ``data_ptr`` it had at capture (a reallocated buffer would be ignored by a real replay);
- capture and replay run under a guard that raises on host syncs (``.item()``, ``.tolist()``,
  ``nonzero``, boolean-mask indexing, device-to-host copies), which a real graph cannot
  contain, or would have frozen at capture time;
- outputs land in the tensors returned at capture, as a real replay's would.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNC_OPS = {
    "aten::_local_scalar_dense",
    "aten::nonzero",
    "aten::masked_select",
    "aten::unique",
    "aten::_unique2",
    "aten::unique_consecutive",
    "aten::repeat_interleave.Tensor",
}


class HostSyncError(RuntimeError):
    """A captured region tried to read device data on the host."""


class GraphBufferError(RuntimeError):
    """A static buffer was reallocated between capture and replay."""


# Ops that only make views or change metadata: no kernel, so no graph node.
VIEW_OPS = {
    "aten::view", "aten::_unsafe_view", "aten::_reshape_alias", "aten::reshape", "aten::slice",
    "aten::select", "aten::as_strided", "aten::expand", "aten::t", "aten::transpose",
    "aten::unsqueeze", "aten::squeeze", "aten::detach", "aten::alias", "aten::permute",
    "aten::unflatten", "aten::flatten", "aten::split", "aten::chunk", "aten::narrow",
    "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::lift_fresh",
}


class _NoHostSync(TorchDispatchMode):
    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where
        self.kernels = 0  # ops that would launch a kernel (a graph node on CUDA)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name() if hasattr(func, "name") else str(func)
        if name.split(".")[0] not in VIEW_OPS:
            self.kernels += 1
        if name in SYNC_OPS or (name.startswith("aten::index.Tensor") and _has_bool_index(args)):
            raise HostSyncError(f"host sync inside {self.where}: {name}")
        if name in ("aten::_to_copy", "aten::copy_", "aten::to.device"):
            _check_no_d2h(func, args, kwargs or {}, self.where)
        return func(*args, **(kwargs or {}))


def _has_bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


def _check_no_d2h(func, args, kwargs, where: str) -> None:
    name = func.name()
    if name == "aten::copy_":
        dst, src = args[0], args[1]
        if src.device.type == "cuda" and dst.device.type == "cpu":
            raise HostSyncError(f"device-to-host copy inside {where}")
    elif name == "aten::_to_copy":
        dev = kwargs.get("device")
        if dev is not None and torch.device(dev).type == "cpu" and args[0].device.type == "cuda":
            raise HostSyncError(f"device-to-host copy inside {where}")


class _PatchedTensorMethods:
    """``tolist``/``numpy``/``__bool__`` etc. bypass the dispatcher; patch them for the guard."""

    NAMES = ("tolist", "numpy", "__bool__", "__int__", "__float__", "__index__")

    def __init__(self, where: str) -> None:
        self.where = where
        self.saved: dict[str, object] = {}

    def __enter__(self):
        for name in self.NAMES:
            self.saved[name] = getattr(torch.Tensor, name)

            def raiser(*_a, _name=name, **_k):
                raise HostSyncError(f"host sync inside {self.where}: Tensor.{_name}()")

            setattr(torch.Tensor, name, raiser)
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(torch.Tensor, name, fn)
        return False


class no_host_sync:
    """Context manager: raise ``HostSyncError`` on any host sync in the block."""

    def __init__(self, where: str) -> None:
        self.mode = _NoHostSync(where)
        self.patch = _PatchedTensorMethods(where)

    def __enter__(self):
        self.patch.__enter__()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)
        self.patch.__exit__(*exc)
        return False


class StandInGraph:
    """Capture once, replay many times, with the invariants of a CUDA graph checked."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.fn: Callable[[], Sequence[torch.Tensor]] | None = None
        self.static: list[tuple[str, Callable[[], torch.Tensor], int]] = []
        self.outputs: list[torch.Tensor] = []
        self.replays = 0
        self.num_nodes = 0  # kernels the capture ran: what a CUDA graph would hold as nodes

    def capture(self, fn: Callable[[], Sequence[torch.Tensor]],
                static: dict[str, Callable[[], torch.Tensor]]) -> list[torch.Tensor]:
        """Run ``fn`` once under the guard; remember the addresses of its static buffers.

        ``static`` maps a name to a getter, so a buffer replaced by a new tensor (not only one
        resized in place) is caught at replay.
        """
        self.fn = fn
        self.static = [(k, get, get().data_ptr()) for k, get in static.items()]
        guard = no_host_sync(f"capture of graph {self.name}")
        with guard:
            self.outputs = list(fn())
        self.num_nodes = guard.mode.kernels
        return self.outputs

    def replay(self) -> None:
        assert self.fn is not None, "replay before capture"
        for key, get, ptr in self.static:
            tensor = get()
            if tensor.data_ptr() != ptr:
                raise GraphBufferError(
                    f"graph {self.name}: static buffer {key!r} moved since capture "
                    f"({ptr:#x} -> {tensor.data_ptr():#x}); a CUDA graph would read stale memory"
                )
        with no_host_sync(f"replay of graph {self.name}"):
            fresh = self.fn()
        for out, new in zip(self.outputs, fresh):
            out.copy_(new)
        self.replays += 1
