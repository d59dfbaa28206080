"""The pointer audit: does any captured CUDA graph hold an address of memory that is gone?

A captured graph bakes raw device addresses into its kernels' parameters. ``audit_graphs``
reads every kernel node of every graph (``cuGraphGetNodes``, ``cuGraphNodeGetType``,
``cuGraphKernelNodeGetParams``), lays out each kernel's parameters (``cuFuncGetParamInfo``:
offset and size of parameter i) and reads each parameter's bytes from the node's
``kernelParams`` (a host array of pointers to the values). Every 8-byte word aligned in the
parameter buffer is a candidate address (pointers sit at 8-byte offsets, also inside struct
parameters). A word is checked when it falls inside memory the engine knows (``AddressBook``):
an arena region's reserved range (``memory.arena``; every chunk of the region must be
mapped, as a tensor may span them from a pointer into any one), or a segment of torch's caching
allocator seen when the graphs were captured. It must lie in memory that is mapped or
allocated now: a word inside an arena region's unmapped chunk, or inside a torch segment
that has since been released, is a dangling pointer, and the audit raises
``GraphAuditError`` naming the graph's mode and tier, the kernel (``cuFuncGetName``), the
node and the parameter index. Words outside every known range (sizes, strides, scalars)
are not addresses the audit can judge and are skipped.

On the CPU the stand-in graphs hold no addresses: the audit checks that every arena region
is mapped and reports no kernels.
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from replaylm.memory.arena import Arena
from replaylm.memory.vmm import as_int, succeeded

log = logging.getLogger(__name__)

MAX_PARAMS = 4096  # a kernel with more parameters than this is read no further
CU_LAUNCH_PARAM_END, CU_LAUNCH_PARAM_BUFFER_POINTER, CU_LAUNCH_PARAM_BUFFER_SIZE = 0, 1, 2


class GraphAuditError(RuntimeError):
    """A captured graph holds the address of memory that is unmapped or freed."""


@dataclass(frozen=True)
class AuditReport:
    """``graphs`` audited, their ``kernels`` (kernel nodes), ``params`` read, 8-byte
    ``words`` looked at, ``pointers`` among them that fell inside known memory (all live),
    ``unreadable`` kernels whose parameters could not be read, and the ``seconds`` it took."""

    graphs: int
    kernels: int
    params: int
    words: int
    pointers: int
    unreadable: int
    seconds: float

    def as_dict(self) -> dict:
        return asdict(self)


def torch_segments(device: torch.device) -> list[tuple[int, int]]:
    """The caching allocator's segments on ``device``: ``[start, end)`` each."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    out = []
    for seg in torch.cuda.memory_snapshot():
        if seg.get("device", index) == index:
            start = int(seg["address"])
            out.append((start, start + int(seg["total_size"])))
    return sorted(out)


class AddressBook:
    """Memory the engine knows: ``arena`` regions (reserved range, chunks mapped or not) and
    torch segments ``known`` (seen at capture) against those ``live`` now.

    ``mapped_at_capture``: the arena chunks mapped when the graphs were captured, if known.
    A word in a segmented region's unmapped tail that was unmapped at capture too is no
    address a replay has used (a graph holding one would have faulted since): it is an integer
    that happens to fall in the reserved range (a resizable KV pool reserves gigabytes) and is
    skipped. Without it, every word in an unmapped tail dangles."""

    def __init__(self, arena: Arena | None, known: Iterable[tuple[int, int]] = (),
                 live: Iterable[tuple[int, int]] = (),
                 mapped_at_capture: Iterable[tuple[int, int]] | None = None) -> None:
        self.arena = arena
        self.known = _merged(known)
        self.live = _merged(live)
        self._known_starts = [s for s, _ in self.known]
        self._live_starts = [s for s, _ in self.live]
        self.at_capture = None if mapped_at_capture is None else _merged(mapped_at_capture)
        self._at_capture_starts = [s for s, _ in self.at_capture or ()]

    @staticmethod
    def _inside(addr: int, ranges: list[tuple[int, int]], starts: list[int]) -> bool:
        i = bisect.bisect_right(starts, addr) - 1
        return i >= 0 and addr < ranges[i][1]

    def check(self, addr: int) -> tuple[bool, str | None]:
        """``(known, why)``: whether ``addr`` is inside known memory, and why it dangles
        (None when it does not)."""
        if self.arena is not None:
            hit = self.arena.locate(addr)
            if hit is not None:
                # A tensor may span the region's chunks from a pointer into any one of them:
                # the whole region must be mapped.
                region, i, chunk = hit
                if chunk is None:
                    if self.at_capture is not None and not self._inside(
                            addr, self.at_capture, self._at_capture_starts):
                        return False, None
                    return True, (f"arena region {region.name!r} at offset "
                                  f"{addr - region.ptr}: reserved, not mapped (beyond the "
                                  "mapped part of its segment)")
                gone = [j for j, c in enumerate(region.chunks) if not c.mapped]
                if not gone:
                    return True, None
                return True, (f"arena region {region.name!r} (pointer in chunk {i} at "
                              f"{chunk.ptr:#x}) whose chunks {gone} are unmapped")
        if self._inside(addr, self.known, self._known_starts):
            if self._inside(addr, self.live, self._live_starts):
                return True, None
            return True, "a torch allocator segment that has since been released"
        if self._inside(addr, self.live, self._live_starts):
            return True, None
        return False, None


def _merged(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for s, e in sorted(ranges):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def mode_and_tier(name: str) -> tuple[str, str]:
    """A graph's mode and tier from its name (``ragged:16``, ``piecewise:16:link3``)."""
    parts = name.split(":")
    return parts[0], (parts[1] if len(parts) > 1 else "?")


def audit_graphs(graphs: Iterable[Any], book: AddressBook) -> AuditReport:
    """Audit ``graphs`` (``graphs.graph.Graph`` objects: ``name``, ``cuda``, ``graph``)
    against ``book``; raise ``GraphAuditError`` at the first dangling pointer."""
    t0 = time.perf_counter()
    graphs = list(graphs)
    totals = {"kernels": 0, "params": 0, "words": 0, "pointers": 0, "unreadable": 0}
    cuda = [g for g in graphs if getattr(g, "cuda", False)]
    if not cuda and book.arena is not None:
        for region in book.arena.regions.values():
            if not region.mapped:
                raise GraphAuditError(
                    f"graph audit: arena region {region.name!r} is not mapped: "
                    f"{len(graphs)} graphs would read it")
    if cuda:
        from cuda.bindings import driver as drv

        for g in cuda:
            _audit_one(drv, g, book, totals)
    return AuditReport(len(graphs), totals["kernels"], totals["params"], totals["words"],
                       totals["pointers"], totals["unreadable"], time.perf_counter() - t0)


def _ok(out: Any) -> bool:
    return succeeded(out[0] if isinstance(out, tuple) else out)


def _graph_handle(drv: Any, g: Any) -> Any:
    raw = g.graph.raw_cuda_graph()
    return drv.CUgraph(init_value=int(raw)) if isinstance(raw, int) else raw


def _audit_one(drv: Any, g: Any, book: AddressBook, totals: dict) -> None:
    mode, tier = mode_and_tier(g.name)
    where = f"mode {mode}, tier {tier} (graph {g.name!r})"
    handle = _graph_handle(drv, g)
    out = drv.cuGraphGetNodes(handle, 0)
    if not _ok(out):
        raise GraphAuditError(f"graph audit: cuGraphGetNodes failed on {where}: {out[0]!r}")
    count = int(out[-1])
    out = drv.cuGraphGetNodes(handle, count)
    if not _ok(out):
        raise GraphAuditError(f"graph audit: cuGraphGetNodes failed on {where}: {out[0]!r}")
    kernel_type = drv.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL
    for n, node in enumerate(out[1][:count]):
        kind = drv.cuGraphNodeGetType(node)
        if not _ok(kind) or as_int(kind[1]) != as_int(kernel_type):
            continue
        totals["kernels"] += 1
        got = drv.cuGraphKernelNodeGetParams(node)
        if not _ok(got):
            totals["unreadable"] += 1
            continue
        params = got[1]
        func, kern = getattr(params, "func", None), getattr(params, "kern", None)
        values = _param_values(drv, params, func, kern)
        if values is None:
            totals["unreadable"] += 1
            continue
        for index, offset, data in values:
            totals["params"] += 1
            for j in range((-offset) % 8, len(data) - 7, 8):
                word = int.from_bytes(data[j:j + 8], "little")
                totals["words"] += 1
                known, why = book.check(word)
                if not known:
                    continue
                totals["pointers"] += 1
                if why is not None:
                    raise GraphAuditError(
                        f"graph audit: {where}: kernel {_name(drv, func, kern)!r} (node {n}) "
                        f"parameter {index} (byte {j}) holds {word:#x}, inside {why}: a "
                        "replay would read unmapped or freed memory")


def _address(x: Any) -> int:
    """A pointer field of a cuda-python struct as an int (0 when absent)."""
    if x is None:
        return 0
    try:
        return int(x)
    except (TypeError, ValueError):
        get = getattr(x, "getPtr", None)
        return int(get()) if get is not None else 0


def _layout(drv: Any, func: Any, kern: Any) -> list[tuple[int, int]] | None:
    """``(offset, size)`` of each parameter of the kernel; None if it cannot be read."""
    if _address(func):
        getter, target = getattr(drv, "cuFuncGetParamInfo", None), func
    elif _address(kern):
        getter, target = getattr(drv, "cuKernelGetParamInfo", None), kern
    else:
        return None
    if getter is None:
        return None
    out = []
    for i in range(MAX_PARAMS):
        res = getter(target, i)
        if not _ok(res):
            break  # past the last parameter (CUDA_ERROR_INVALID_VALUE)
        out.append((int(res[1]), int(res[2])))
    return out


def _param_values(drv: Any, params: Any, func: Any, kern: Any
                  ) -> list[tuple[int, int, bytes]] | None:
    """``(index, offset, bytes)`` of each parameter of a kernel node, read from its
    ``kernelParams`` array (or its ``extra`` buffer, as one parameter); None if neither can be
    read."""
    kp = _address(getattr(params, "kernelParams", None))
    layout = _layout(drv, func, kern)
    if kp and layout is not None:
        out = []
        for i, (offset, size) in enumerate(layout):
            arg = ctypes.c_void_p.from_address(kp + 8 * i).value
            if not arg:
                return None
            out.append((i, offset, ctypes.string_at(arg, size)))
        return out
    extra = _address(getattr(params, "extra", None))
    if not extra:
        return [] if layout == [] else None
    buf = size = 0
    for k in range(0, 64, 2):  # (key, value) pairs up to CU_LAUNCH_PARAM_END
        key = ctypes.c_void_p.from_address(extra + 8 * k).value or 0
        if key == CU_LAUNCH_PARAM_END:
            break
        value = ctypes.c_void_p.from_address(extra + 8 * (k + 1)).value or 0
        if key == CU_LAUNCH_PARAM_BUFFER_POINTER:
            buf = value
        elif key == CU_LAUNCH_PARAM_BUFFER_SIZE and value:
            size = ctypes.c_size_t.from_address(value).value
    if not buf or not size:
        return None
    return [(0, 0, ctypes.string_at(buf, size))]


def _name(drv: Any, func: Any, kern: Any) -> str:
    for getter, target in (("cuFuncGetName", func), ("cuKernelGetName", kern)):
        fn = getattr(drv, getter, None)
        if fn is None or not _address(target):
            continue
        try:
            res = fn(target)
        except Exception:  # a name is a courtesy
            continue
        if _ok(res) and res[1]:
            return res[1].decode() if isinstance(res[1], bytes) else str(res[1])
    return "?"
