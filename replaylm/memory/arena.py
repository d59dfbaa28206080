"""``Arena``: regions of memory whose addresses stay put while their contents sleep.

A region is one contiguous range of bytes, handed out as tensor views (``Region.view``).
On CUDA its addresses are a reserved virtual range (``vmm.reserve``) backed by physical
chunks (``CHUNK_BYTES`` at most each, multiples of the allocation granularity) mapped into it;
``release()`` unmaps and frees every chunk (the addresses stay reserved, every view keeps its
``data_ptr``), ``remap()`` maps fresh physical memory at the same addresses. Reading a view
while it is released is an illegal address on the device: nothing may run then.

On the CPU (CI) a region is a plain buffer: ``release()`` poisons it (every byte 0xFF, a NaN
in every float dtype) so a stale read shows, and ``remap()`` marks it live again; the
contents are whatever the caller restores.

A segmented region (``Arena.segmented``) reserves ``count`` equal segments and maps only a
prefix of each (``Region.fit``): the KV pool keeps each layer's K and V in a segment reserved
for the largest pool, so growing or shrinking the pool maps or unmaps physical chunks at the
end of every segment while each layer's tensor keeps its address and strides.

``adopt_parameters`` moves a module's parameters into one region (``param.data`` becomes a
view of it), so graphs captured afterwards bake in arena addresses.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from replaylm.memory import vmm

log = logging.getLogger(__name__)

#: Largest physical chunk of a region (rounded to the granularity): a region maps several.
CHUNK_BYTES = 512 * 2**20
#: Alignment of each tensor view inside a region.
VIEW_ALIGN = 256
#: The byte every float reads as NaN (0xFF.. is a NaN in fp32, fp16 and bf16 alike).
POISON_BYTE = 0xFF


@dataclass(eq=False)
class Chunk:
    """``size`` bytes at ``ptr`` of a region; ``handle`` is its physical allocation (CUDA)
    while mapped, None while released."""

    ptr: int
    size: int
    handle: Any = None
    mapped: bool = True


@dataclass(eq=False)
class Region:
    """One named range of an arena: ``nbytes`` asked for, ``size`` reserved (rounded up),
    ``bytes`` the whole range as a uint8 tensor, ``chunks`` its physical pieces (in address
    order). A segmented region (``segment`` > 0) has ``size // segment`` segments of which
    only a prefix of each has chunks (``fit``); the rest of the range is reserved, unmapped."""

    arena: Arena
    name: str
    ptr: int
    nbytes: int
    size: int
    bytes: torch.Tensor
    chunks: list[Chunk] = field(default_factory=list)
    _used: int = 0
    segment: int = 0

    @property
    def mapped(self) -> bool:
        """Whether every chunk the region has is mapped (a segmented region's unmapped tails
        hold no chunk: they are outside the region's memory, not asleep)."""
        return all(c.mapped for c in self.chunks)

    @property
    def chunk_bytes(self) -> int:
        """Bytes of the region's chunks, mapped or not: its physical memory while awake."""
        return sum(c.size for c in self.chunks)

    def view(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A tensor of ``shape`` and ``dtype`` at byte ``offset`` of the region."""
        n = dtype.itemsize
        for d in shape:
            n *= d
        if offset % dtype.itemsize or offset + n > self.nbytes:
            raise ValueError(f"region {self.name!r}: {n} bytes at offset {offset} do not fit "
                             f"its {self.nbytes} bytes (or are misaligned for {dtype})")
        return self.bytes[offset:offset + n].view(dtype).view(shape)

    def take(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The next free, ``VIEW_ALIGN``-aligned view of the region (a bump allocator)."""
        offset = -(-self._used // VIEW_ALIGN) * VIEW_ALIGN
        t = self.view(offset, dtype, shape)
        self._used = offset + t.numel() * dtype.itemsize
        return t

    def release(self) -> None:
        """Free the physical memory (CUDA: unmap and release each chunk; CPU: poison it);
        the addresses stay."""
        self.arena._release(self)

    def remap(self) -> None:
        """Physical memory back at the same addresses (CUDA: contents undefined; CPU: the
        poisoned bytes as they are)."""
        self.arena._remap(self)

    def fit(self, used: int) -> None:
        """A segmented region's first ``used`` bytes of every segment mapped (rounded up to
        the granularity), the rest of each segment unmapped and its memory freed; the bytes
        kept hold their contents, the newly mapped ones are zeroed (``Arena.fit``)."""
        self.arena.fit(self, used)

    def poison(self) -> None:
        self.fill(POISON_BYTE)

    def fill(self, value: int) -> None:
        """Every byte of every chunk set to ``value`` (the unmapped parts left alone)."""
        for lo, hi in self.spans():
            self.bytes[lo:hi].fill_(value)

    def spans(self) -> list[tuple[int, int]]:
        """The chunks' ``[start, end)`` offsets in the region, adjacent ones merged."""
        out: list[tuple[int, int]] = []
        for c in self.chunks:
            lo = c.ptr - self.ptr
            if out and out[-1][1] == lo:
                out[-1] = (out[-1][0], lo + c.size)
            else:
                out.append((lo, lo + c.size))
        return out


class Arena:
    """The address-stable regions of one device (``regions`` by name)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.regions: dict[str, Region] = {}
        self.granularity = 1
        self.index = 0
        if self.cuda:
            self.index = device.index if device.index is not None else torch.cuda.current_device()
            self.device = torch.device("cuda", self.index)
            vmm.ensure_context(self.device)
            self.granularity = vmm.granularity(self.index)

    # Regions ---------------------------------------------------------------------------------

    def region(self, name: str, nbytes: int) -> Region:
        """A new region of at least ``nbytes`` bytes (mapped, contents undefined on CUDA and
        zero on the CPU)."""
        if name in self.regions:
            raise ValueError(f"arena region {name!r} exists already")
        nbytes = max(int(nbytes), 1)
        if not self.cuda:
            buf = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
            region = Region(self, name, buf.data_ptr(), nbytes, nbytes, buf,
                            [Chunk(buf.data_ptr(), nbytes)])
            self.regions[name] = region
            return region
        g = self.granularity
        size = -(-nbytes // g) * g
        ptr = vmm.reserve(size, g)
        chunks, step = [], max(g, CHUNK_BYTES // g * g)
        try:
            for off in range(0, size, step):
                chunks.append(Chunk(ptr + off, min(step, size - off)))
            for c in chunks:
                self._map(c)
        except BaseException:
            for c in chunks:
                self._unmap(c)
            vmm.free_address(ptr, size)
            raise
        region = Region(self, name, ptr, nbytes, size, vmm.as_tensor(ptr, size, self.device),
                        chunks)
        self.regions[name] = region
        log.info("arena region %s: %.1f MiB at %#x in %d chunks", name, size / 2**20, ptr,
                 len(chunks))
        return region

    def segmented(self, name: str, count: int, segment_bytes: int, used: int) -> Region:
        """A region of ``count`` segments of ``segment_bytes`` each (rounded up to the
        granularity), of which the first ``used`` bytes of each are mapped and zeroed
        (``Region.fit``). On the CPU the whole range is one plain buffer."""
        if name in self.regions:
            raise ValueError(f"arena region {name!r} exists already")
        g = self.granularity
        segment = -(-max(int(segment_bytes), 1) // g) * g
        size = count * segment
        if self.cuda:
            ptr = vmm.reserve(size, g)
            buf = vmm.as_tensor(ptr, size, self.device)
        else:
            buf = torch.full((size,), POISON_BYTE, dtype=torch.uint8, device=self.device)
            ptr = buf.data_ptr()
        region = Region(self, name, ptr, size, size, buf, [], segment=segment)
        try:
            self.fit(region, used)
        except BaseException:
            if self.cuda:
                for c in region.chunks:
                    self._unmap(c)
                vmm.free_address(ptr, size)
            raise
        self.regions[name] = region
        log.info("arena region %s: %d segments of %.1f MiB reserved at %#x, %.1f MiB mapped",
                 name, count, segment / 2**20, ptr, region.chunk_bytes / 2**20)
        return region

    def fit(self, region: Region, used: int) -> None:
        """Map the first ``used`` bytes (rounded up to the granularity) of each segment of
        ``region`` and unmap the rest. Chunks wholly kept stay as they are; a chunk that
        straddles the new end is replaced by a smaller one holding the same leading bytes
        (copied through a temporary buffer: a physical allocation is freed whole or not at
        all); the gaps up to the new end get new chunks, zeroed. A failure to map (out of
        device memory) unmaps what this call mapped and raises ``VMMError``, the region as
        it was. On the CPU, bytes leaving the region are poisoned and new ones zeroed."""
        seg = region.segment
        if seg <= 0:
            raise ValueError(f"arena region {region.name!r} is not segmented: it cannot be fit")
        if not region.mapped:
            raise RuntimeError(f"arena region {region.name!r} is released (asleep): wake it "
                               "before resizing it")
        g = self.granularity
        want = min(seg, -(-max(int(used), 0) // g) * g)
        if self.cuda:
            torch.cuda.synchronize(self.device)
        added: list[Chunk] = []  # mapped by this call: unmapped again if a later map fails
        fresh: list[Chunk] = []  # new memory, zeroed at the end
        try:
            kept = self._trim(region, want, added)
            step = max(g, CHUNK_BYTES // g * g)
            for start in range(0, region.size, seg):
                end = max((c.ptr - region.ptr + c.size for c in kept
                           if start <= c.ptr - region.ptr < start + seg), default=start)
                for off in range(end, start + want, step):
                    c = Chunk(region.ptr + off, min(step, start + want - off))
                    if self.cuda:
                        c.mapped = False
                        self._map(c)
                    added.append(c)
                    fresh.append(c)
                    kept.append(c)
        except BaseException:
            for c in added:
                if self.cuda:
                    self._unmap(c)
            raise
        region.chunks = sorted(kept, key=lambda c: c.ptr)
        for c in fresh:
            lo = c.ptr - region.ptr
            region.bytes[lo:lo + c.size].zero_()

    def _trim(self, region: Region, want: int, added: list[Chunk]) -> list[Chunk]:
        """``region``'s chunks cut to the first ``want`` bytes of each segment (``fit``)."""
        kept: list[Chunk] = []
        seg = region.segment
        for c in region.chunks:
            lo = c.ptr - region.ptr
            end = min(lo + c.size, lo // seg * seg + want)
            if end >= lo + c.size:
                kept.append(c)
                continue
            if not self.cuda:
                region.bytes[max(lo, end):lo + c.size].fill_(POISON_BYTE)
                if end > lo:
                    kept.append(Chunk(c.ptr, end - lo))
                continue
            saved = region.bytes[lo:end].clone() if end > lo and c.mapped else None
            self._unmap(c)
            if end > lo:
                piece = Chunk(c.ptr, end - lo, mapped=False)
                self._map(piece)
                added.append(piece)  # a failure later unmaps it (the saved bytes are lost)
                if saved is not None:
                    region.bytes[lo:end].copy_(saved)
                kept.append(piece)
        return kept

    def zeros(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A region holding one zeroed tensor of ``shape``."""
        n = dtype.itemsize * math.prod(shape)
        t = self.region(name, n).take(dtype, tuple(shape))
        t.zero_()
        return t

    @property
    def mapped_bytes(self) -> int:
        return sum(c.size for r in self.regions.values() for c in r.chunks if c.mapped)

    # Addresses, for the pointer audit ----------------------------------------------------------

    def locate(self, addr: int) -> tuple[Region, int, Chunk | None] | None:
        """The region, chunk index and chunk whose reserved range holds ``addr``; chunk
        ``(-1, None)`` for an address in a region's reserved range that no chunk covers (a
        segmented region's unmapped tail); None outside every region."""
        for r in self.regions.values():
            if r.ptr <= addr < r.ptr + r.size:
                for i, c in enumerate(r.chunks):
                    if c.ptr <= addr < c.ptr + c.size:
                        return r, i, c
                return r, -1, None
        return None

    def mapped_ranges(self) -> list[tuple[int, int]]:
        """Every mapped chunk's ``[start, end)``."""
        chunks = (c for r in self.regions.values() for c in r.chunks)
        return [(c.ptr, c.ptr + c.size) for c in chunks if c.mapped]

    # Physical memory -------------------------------------------------------------------------

    def _map(self, c: Chunk) -> None:
        handle = vmm.create(c.size, self.index)
        try:
            vmm.map_at(c.ptr, c.size, handle, self.index)
        except BaseException:
            vmm.release(handle)
            raise
        c.handle, c.mapped = handle, True

    def _unmap(self, c: Chunk) -> None:
        if c.handle is None:
            c.mapped = False
            return
        if c.mapped:
            vmm.unmap(c.ptr, c.size)
            c.mapped = False
        vmm.release(c.handle)
        c.handle = None

    def unmap_chunk(self, region: Region, index: int) -> None:
        """Unmap and free one chunk of ``region`` (the pointer audit's test)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
            self._unmap(region.chunks[index])
        else:
            c = region.chunks[index]
            lo = c.ptr - region.ptr
            region.bytes[lo:lo + c.size].fill_(POISON_BYTE)
            c.mapped = False

    def _release(self, region: Region) -> None:
        if not self.cuda:
            region.poison()
            for c in region.chunks:
                c.mapped = False
            return
        torch.cuda.synchronize(self.device)
        for c in region.chunks:
            self._unmap(c)

    def _remap(self, region: Region) -> None:
        if not self.cuda:
            for c in region.chunks:
                c.mapped = True
            return
        torch.cuda.synchronize(self.device)
        for c in region.chunks:
            if not c.mapped:
                self._map(c)

    def close(self) -> None:
        """Free every region's memory and addresses (views must be gone: nothing may touch
        them afterwards)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
            for r in self.regions.values():
                for c in r.chunks:
                    self._unmap(c)
                vmm.free_address(r.ptr, r.size)
        self.regions.clear()


def parameter_bytes(module: torch.nn.Module) -> int:
    """Bytes one region needs to hold every parameter of ``module``, each view aligned."""
    total = 0
    for p in module.parameters():
        total = -(-total // VIEW_ALIGN) * VIEW_ALIGN + p.numel() * p.element_size()
    return total


@torch.no_grad()
def adopt_parameters(module: torch.nn.Module, arena: Arena, name: str) -> Region:
    """Move every parameter of ``module`` into a new region ``name``: each ``param.data``
    becomes a view of the region holding a copy of its values (tied parameters stay tied:
    one Parameter object, moved once). The old storage is freed once nothing else holds it."""
    params = list(module.parameters())  # deduplicated: a tied weight appears once
    region = arena.region(name, parameter_bytes(module))
    for p in params:
        view = region.take(p.dtype, tuple(p.shape))
        view.copy_(p.data)
        p.data = view
    if arena.cuda:
        torch.cuda.synchronize(arena.device)
    return region
