"""What the driver and each device can do, for ``ipcpool doctor`` (seed 000: capability query).

Plain data out (ints, bools, strs, lists, dicts), so the CLI can print it or dump it as JSON.
"""

from __future__ import annotations

from typing import Any

from cuda.bindings import driver as cu

from .errors import check

_A = cu.CUdevice_attribute

# CUmemAllocationHandleType bits, as the pool's supported-handle-types attribute reports them.
HANDLE_TYPE_BITS = {
    "posix_fd": 0x1,
    "win32": 0x2,
    "win32_kmt": 0x4,
    "fabric": 0x8,
}

_DEVICE_FLAGS = {
    "mempool_supported": "CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED",
    "ipc_event_supported": "CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED",
    "vmm_supported": "CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED",
    "posix_fd_supported": "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED",
    "compression_supported": "CU_DEVICE_ATTRIBUTE_GENERIC_COMPRESSION_SUPPORTED",
    "fabric_supported": "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED",
    "unified_addressing": "CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING",
}


def _attr(dev: Any, name: str) -> int | None:
    attr = getattr(_A, name, None)
    if attr is None:  # older bindings: the attribute does not exist there
        return None
    err, value = cu.cuDeviceGetAttribute(attr, dev)
    return int(value) if err == cu.CUresult.CUDA_SUCCESS else None


def _version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


def capabilities() -> dict[str, Any]:
    """Driver version, and per device: name, memory, mempool/IPC/VMM/compression support, the
    pool's supported handle types; plus the peer-access matrix (``peer_access[i][j]``: device i can
    access memory resident on device j)."""
    check(cu.cuInit(0), "cuInit")
    driver = int(check(cu.cuDriverGetVersion(), "cuDriverGetVersion"))
    count = int(check(cu.cuDeviceGetCount(), "cuDeviceGetCount"))
    devices = []
    handles = []
    for ordinal in range(count):
        dev = check(cu.cuDeviceGet(ordinal), "cuDeviceGet")
        handles.append(dev)
        name = check(cu.cuDeviceGetName(256, dev), "cuDeviceGetName")
        name = name.split(b"\0", 1)[0].decode(errors="replace") if isinstance(name, bytes) else str(name)
        info: dict[str, Any] = {
            "ordinal": ordinal,
            "name": name,
            "total_memory": int(check(cu.cuDeviceTotalMem(dev), "cuDeviceTotalMem")),
            "compute_capability": (
                f"{_attr(dev, 'CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR')}."
                f"{_attr(dev, 'CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR')}"
            ),
        }
        for key, attr in _DEVICE_FLAGS.items():
            value = _attr(dev, attr)
            info[key] = None if value is None else bool(value)
        bits = _attr(dev, "CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES") if info["mempool_supported"] else 0
        info["mempool_handle_types"] = [n for n, b in HANDLE_TYPE_BITS.items() if bits and bits & b]
        info["mempool_posix_fd"] = bool(bits and bits & HANDLE_TYPE_BITS["posix_fd"])
        devices.append(info)
    peer = [
        [True if i == j else bool(check(cu.cuDeviceCanAccessPeer(handles[i], handles[j]), "cuDeviceCanAccessPeer"))
         for j in range(count)]
        for i in range(count)
    ]
    return {
        "driver_version": driver,
        "driver": _version(driver),
        "device_count": count,
        "devices": devices,
        "peer_access": peer,
        # What ipcpool needs: stream-ordered pools exportable as POSIX FDs, and IPC events.
        "ipcpool_ready": bool(devices) and all(
            d["mempool_supported"] and d["mempool_posix_fd"] and d["ipc_event_supported"] for d in devices
        ),
    }
