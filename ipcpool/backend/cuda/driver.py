"""The few driver calls cuda.core has no API for, through cuda.bindings, with errors translated.

cuda.core covers pools, buffers, streams and events; what is left here is pool attributes that
cuda.core only reads (release threshold, reuse policies, resetting the high marks), trimming,
access on an *imported* pool, peer checks, stream queries, copies between raw addresses and
plain (non-pool) allocations, which cuda.core makes only through private classes.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

from cuda.bindings import driver as cu

from ...errors import IpcPoolError
from .errors import check, error_name

UINT64_MAX = (1 << 64) - 1

_ATTR = cu.CUmemPool_attribute
REUSE_ATTRS = {
    "follow_event_dependencies": _ATTR.CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES,
    "allow_opportunistic": _ATTR.CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC,
    "allow_internal_dependencies": _ATTR.CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES,
}
_U64_ATTRS = {
    "release_threshold": _ATTR.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
    "reserved": _ATTR.CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
    "reserved_high": _ATTR.CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
    "used": _ATTR.CU_MEMPOOL_ATTR_USED_MEM_CURRENT,
    "used_high": _ATTR.CU_MEMPOOL_ATTR_USED_MEM_HIGH,
}


def pool_handle(mr: Any) -> Any:
    """The CUmemoryPool behind a cuda.core DeviceMemoryResource."""
    return cu.CUmemoryPool(int(mr.handle))


def get_u64(pool: Any, key: str) -> int:
    return int(check(cu.cuMemPoolGetAttribute(pool, _U64_ATTRS[key]), f"cuMemPoolGetAttribute({key})"))


def set_u64(pool: Any, key: str, value: int) -> None:
    check(cu.cuMemPoolSetAttribute(pool, _U64_ATTRS[key], cu.cuuint64_t(value)), f"cuMemPoolSetAttribute({key})")


def set_reuse(pool: Any, policy: str, enabled: bool) -> None:
    check(cu.cuMemPoolSetAttribute(pool, REUSE_ATTRS[policy], int(bool(enabled))), f"cuMemPoolSetAttribute({policy})")


def get_reuse(pool: Any, policy: str) -> bool:
    return bool(check(cu.cuMemPoolGetAttribute(pool, REUSE_ATTRS[policy]), f"cuMemPoolGetAttribute({policy})"))


def trim_to(pool: Any, keep: int) -> None:
    check(cu.cuMemPoolTrimTo(pool, keep), "cuMemPoolTrimTo")


def can_access_peer(accessing: int, resident: int) -> bool:
    return bool(check(cu.cuDeviceCanAccessPeer(accessing, resident), "cuDeviceCanAccessPeer"))


@functools.cache   # fixed for the process's life (CUDA_VISIBLE_DEVICES is read at cuInit)
def device_count() -> int:
    return int(check(cu.cuDeviceGetCount(), "cuDeviceGetCount"))


@functools.cache
def total_memory(device: int) -> int:
    return int(check(cu.cuDeviceTotalMem(device), "cuDeviceTotalMem"))


def access_descs(devices: list[int]) -> list[Any]:
    """Read-write access for each of ``devices`` (structs only: no driver call)."""
    descs = []
    for dev in devices:
        desc = cu.CUmemAccessDesc()
        desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = dev
        desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        descs.append(desc)
    return descs


def set_access(pool: Any, devices: list[int]) -> None:
    """Grant read-write access to ``devices`` on ``pool`` (exported or imported: access is per
    process, so every importer on another device must call this on its own imported pool)."""
    descs = access_descs(devices)
    if descs:
        check(cu.cuMemPoolSetAccess(pool, descs, len(descs)), "cuMemPoolSetAccess")


def query_stream(stream: Any) -> bool:
    """True when all work on ``stream`` is done; never blocks. Also lets the driver learn which
    stream-ordered frees completed, so a following trim can release their memory."""
    err = cu.cuStreamQuery(cu.CUstream(int(stream.handle)))[0]
    if err == cu.CUresult.CUDA_SUCCESS:
        return True
    if err == cu.CUresult.CUDA_ERROR_NOT_READY:
        return False
    raise IpcPoolError(f"cuStreamQuery failed: {error_name(err)}")


def current_context() -> Any:
    """The calling thread's current context (a CUcontext; 0 when none)."""
    result = cu.cuCtxGetCurrent()
    if result[0] == cu.CUresult.CUDA_ERROR_NOT_INITIALIZED:
        check(cu.cuInit(0), "cuInit")
        result = cu.cuCtxGetCurrent()
    return check(result, "cuCtxGetCurrent")


def current_device() -> int | None:
    """The device of the calling thread's current context; None when no context is current."""
    if int(current_context()) == 0:
        return None
    return int(check(cu.cuCtxGetDevice(), "cuCtxGetDevice"))


def primary_active(device: int) -> bool:
    """Is ``device``'s primary context active in this process (some code here has used it)?"""
    _flags, active = check(cu.cuDevicePrimaryCtxGetState(device), "cuDevicePrimaryCtxGetState")
    return bool(active)


def restore_context(ctx: Any) -> None:
    check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


def copy_from_host(dst_ptr: int, src: memoryview, stream_handle: int) -> None:
    """Copy host bytes to device memory on a stream. From pageable memory the call returns once
    the source has been staged, so ``src`` may be reused at once."""
    staged = bytearray(src) if src.readonly else src
    n = len(staged)
    if n == 0:
        return
    address = ctypes.addressof((ctypes.c_ubyte * n).from_buffer(staged))
    check(cu.cuMemcpyHtoDAsync(dst_ptr, address, n, cu.CUstream(stream_handle)), "cuMemcpyHtoDAsync")


def copy(dst_ptr: int, src_ptr: int, nbytes: int, stream_handle: int) -> None:
    """Copy between any two addresses of this process (unified addressing: device or host) on a
    stream."""
    check(cu.cuMemcpyAsync(dst_ptr, src_ptr, nbytes, cu.CUstream(stream_handle)), "cuMemcpyAsync")


def alloc(nbytes: int) -> int:
    """Device memory of the current context's device, the plain way (cuMemAlloc: no pool)."""
    return int(check(cu.cuMemAlloc(nbytes), "cuMemAlloc"))


def free(ptr: int) -> None:
    check(cu.cuMemFree(ptr), "cuMemFree")


def stream_context(stream_handle: int) -> Any:
    """The context a stream belongs to (an event recorded on it must be made in that context)."""
    return check(cu.cuStreamGetCtx(cu.CUstream(stream_handle)), "cuStreamGetCtx")


def synchronize_context() -> None:
    """Wait until all work of the current context has finished."""
    check(cu.cuCtxSynchronize(), "cuCtxSynchronize")
