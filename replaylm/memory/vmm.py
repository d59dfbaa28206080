"""CUDA virtual memory management through ``cuda.bindings.driver``: reserve an address
range, create physical allocations, map them into the range and back out, and view mapped
bytes as a torch tensor (``__cuda_array_interface__``).

Every driver call goes through ``_call``, which raises ``VMMError`` naming the call and the
driver's error. The driver module is imported on first use, so CPU-only installs never need
``cuda-python``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch


class VMMError(RuntimeError):
    """A CUDA driver call of virtual memory management failed."""


@functools.cache
def driver() -> Any:
    try:
        from cuda.bindings import driver as drv
    except ImportError as e:  # pragma: no cover - only without cuda-python
        raise VMMError("enable_sleep_mode on CUDA needs cuda-python (pip install "
                       "cuda-python): cuda.bindings.driver is missing") from e
    return drv


def _call(name: str, *args: Any) -> Any:
    """``driver().<name>(*args)``; raise ``VMMError`` unless it returned CUDA_SUCCESS. Returns
    the call's value(s) after the status: None, one value, or a tuple."""
    drv = driver()
    out = getattr(drv, name)(*args)
    status, rest = (out[0], out[1:]) if isinstance(out, tuple) else (out, ())
    if not succeeded(status):
        raise VMMError(f"{name} failed: {error_text(status)}")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


def as_int(value: Any) -> int:
    """A driver enum or handle as an int (``int()``, else its ``value``)."""
    try:
        return int(value)
    except TypeError:
        return int(value.value)


def succeeded(status: Any) -> bool:
    return as_int(status) == 0  # CUDA_SUCCESS


def error_text(status: Any) -> str:
    drv = driver()
    try:
        err, text = drv.cuGetErrorString(status)
        if succeeded(err) and text:
            return f"{status!r} ({text.decode() if isinstance(text, bytes) else text})"
    except Exception:  # an error description is a courtesy
        pass
    return repr(status)


def ensure_context(device: torch.device) -> None:
    """Make the device's primary context (the one torch uses) current on this thread: the
    runtime makes it current on the first runtime call, which ``synchronize`` is."""
    torch.cuda.synchronize(device)


def _prop(device_index: int) -> Any:
    drv = driver()
    prop = drv.CUmemAllocationProp()
    prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device_index
    return prop


def granularity(device_index: int) -> int:
    """The size every mapping is a multiple of (the recommended granularity, 2 MiB on
    current GPUs)."""
    drv = driver()
    flag = drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
    return int(_call("cuMemGetAllocationGranularity", _prop(device_index), flag))


def reserve(size: int, alignment: int) -> int:
    """Reserve ``size`` bytes of virtual addresses; returns the start address."""
    return int(_call("cuMemAddressReserve", size, alignment, 0, 0))


def free_address(ptr: int, size: int) -> None:
    _call("cuMemAddressFree", driver().CUdeviceptr(ptr), size)


def create(size: int, device_index: int) -> Any:
    """A physical allocation of ``size`` bytes on the device; returns its handle."""
    return _call("cuMemCreate", size, _prop(device_index), 0)


def map_at(ptr: int, size: int, handle: Any, device_index: int) -> None:
    """Map ``handle`` at ``ptr`` and give the device read-write access to it."""
    drv = driver()
    _call("cuMemMap", drv.CUdeviceptr(ptr), size, 0, handle, 0)
    desc = drv.CUmemAccessDesc()
    desc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = device_index
    desc.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    try:
        _call("cuMemSetAccess", drv.CUdeviceptr(ptr), size, [desc], 1)
    except VMMError:
        _call("cuMemUnmap", drv.CUdeviceptr(ptr), size)
        raise


def unmap(ptr: int, size: int) -> None:
    _call("cuMemUnmap", driver().CUdeviceptr(ptr), size)


def release(handle: Any) -> None:
    _call("cuMemRelease", handle)


class _CudaBytes:
    """``nbytes`` bytes at ``ptr`` as an object torch can wrap without a copy."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "strides": None,
            "version": 2,
        }


def as_tensor(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over ``nbytes`` bytes of device memory at ``ptr`` (not owned: the
    memory outlives it)."""
    t = torch.as_tensor(_CudaBytes(ptr, nbytes), device=device)
    if t.data_ptr() != ptr or t.numel() != nbytes or t.device != device:
        raise VMMError(f"__cuda_array_interface__ view came out at {t.data_ptr():#x} on "
                       f"{t.device} ({t.numel()} bytes), not {ptr:#x} on {device} "
                       f"({nbytes} bytes)")
    return t
