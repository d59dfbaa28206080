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

``adopt_parameters`` moves a module's parameters into one region (``param.data`` becomes a
view of it), so graphs captured afterwards bake in arena addresses.
"""

from __future__ import annotations

import logging
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
    ``bytes`` the whole range as a uint8 tensor, ``chunks`` its physical pieces."""

    arena: Arena
    name: str
    ptr: int
    nbytes: int
    size: int
    bytes: torch.Tensor
    chunks: list[Chunk] = field(default_factory=list)
    _used: int = 0

    @property
    def mapped(self) -> bool:
        return all(c.mapped for c in self.chunks)

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

    def poison(self) -> None:
        self.bytes.fill_(POISON_BYTE)


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

    def zeros(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A region holding one zeroed tensor of ``shape``."""
        n = dtype.itemsize
        for d in shape:
            n *= d
        t = self.region(name, n).take(dtype, tuple(shape))
        t.zero_()
        return t

    @property
    def mapped_bytes(self) -> int:
        return sum(c.size for r in self.regions.values() for c in r.chunks if c.mapped)

    # Addresses, for the pointer audit ----------------------------------------------------------

    def locate(self, addr: int) -> tuple[Region, int, Chunk] | None:
        """The region, chunk index and chunk whose reserved range holds ``addr``, or None."""
        for r in self.regions.values():
            if r.ptr <= addr < r.ptr + r.size:
                for i, c in enumerate(r.chunks):
                    if c.ptr <= addr < c.ptr + c.size:
                        return r, i, c
        return None

    def ranges(self) -> list[tuple[int, int]]:
        """Every region's reserved ``[start, end)``."""
        return [(r.ptr, r.ptr + r.size) for r in self.regions.values()]

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
