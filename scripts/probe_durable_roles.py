"""The three roles of scripts/probe_durable.py, each run in a spawned process of its own.

EXPORTER (the old broker) makes an IPC pool allocation and a VMM allocation, sends their FDs to the
KEEPER (systemd's FD store: no CUDA) and dies; the ADOPTER (the restarted broker) imports both from
the keeper's duplicates and reports every step to the parent (see scripts/probe_durable.py).
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import time

MiB = 1 << 20
GiB = 1 << 30
SIZE = 64 * MiB
PROBE = 4096                      # bytes read back at each end of an allocation
POOL_PATTERN, VMM_PATTERN, WRITE_PATTERN = 0xA5A5A5A5, 0x5A5A5A5A, 0x11111111
FAIL = object()                   # a failed call; None is a legitimate result (cuMemsetD32 etc.)


class Steps:
    """Runs cuda.bindings calls, recording each outcome in order and streaming it to the parent.
    Step names are "<group>.<what>"; the parent's summary reports each group's first failure.
    strict (exporter): a failure raises. Otherwise (adopter): FAIL comes back and the probe goes on."""

    def __init__(self, ctl, strict: bool):
        self.ctl, self.strict = ctl, strict

    def __call__(self, name: str, fn, *args):
        self.note(name, "started")    # still there after a segfault: the step that crashed
        try:
            r = fn(*args)
            outcome = "ok" if int(r[0]) == 0 else getattr(r[0], "name", str(r[0]))
        except Exception as exc:  # noqa: BLE001 (a wrong binding signature is a finding, not a reason to stop)
            r, outcome = None, f"{type(exc).__name__}: {exc}"
        self.note(name, outcome)
        if outcome != "ok":
            if self.strict:
                raise RuntimeError(f"{name}: {outcome}")
            return FAIL
        return None if len(r) == 1 else r[1] if len(r) == 2 else r[1:]

    def note(self, name: str, value) -> None:
        self.ctl.send(("step", name, value))


def _enums(cu):
    return (cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE,
            cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED)


def _open_device(call, cu):
    """cuInit and device 0's primary context, current on this thread; (name, driver) or FAIL."""
    call("context.cuInit", cu.cuInit, 0)
    dev = call("context.cuDeviceGet", cu.cuDeviceGet, 0)
    ctx = FAIL if dev is FAIL else call("context.cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain, dev)
    if ctx is FAIL or call("context.cuCtxSetCurrent", cu.cuCtxSetCurrent, ctx) is FAIL:
        return FAIL
    name = call("context.cuDeviceGetName", cu.cuDeviceGetName, 256, dev)
    name = "?" if name is FAIL else bytes(name).split(b"\0")[0].decode(errors="replace")
    return name, call("context.cuDriverGetVersion", cu.cuDriverGetVersion)


def _map(call, cu, group: str, handle, size: int):
    """Reserve a VA range, map the VMM handle there, grant device 0 read-write; the VA or FAIL."""
    va = call(f"{group}.cuMemAddressReserve", cu.cuMemAddressReserve, size, 0, 0, 0)
    if va is FAIL or call(f"{group}.cuMemMap", cu.cuMemMap, va, size, 0, handle, 0) is FAIL:
        return FAIL
    desc = cu.CUmemAccessDesc()
    desc.location.type, desc.location.id = _enums(cu)[1], 0
    desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return FAIL if call(f"{group}.cuMemSetAccess", cu.cuMemSetAccess, va, size, [desc], 1) is FAIL else va


def _send(sock, meta: dict, fds) -> None:
    socket.send_fds(sock, [json.dumps(meta).encode()], list(fds))


def _recv(sock, timeout: float):
    sock.settimeout(timeout)
    data, fds, _, _ = socket.recv_fds(sock, 65536, 8)
    return (json.loads(data), fds) if data else None


# ------------------------------------------------------------------------------------------ roles

def exporter_main(ctl, sock, wait_for_kill: bool) -> None:
    from cuda.bindings import driver as cu

    call = Steps(ctl, strict=True)
    try:
        posix, device, pinned = _enums(cu)
        name, driver = _open_device(call, cu)
        stream = call("pool.cuStreamCreate", cu.cuStreamCreate, 0)
        # (a) An IPC-exportable pool, one allocation in it, the pool FD and the pointer's export data.
        props = cu.CUmemPoolProps()
        props.allocType, props.handleTypes = pinned, posix
        props.location.type, props.location.id = device, 0
        if hasattr(props, "maxSize"):
            props.maxSize = GiB
        pool = call("pool.cuMemPoolCreate", cu.cuMemPoolCreate, props)
        ptr = call("pool.cuMemAllocFromPoolAsync", cu.cuMemAllocFromPoolAsync, SIZE, pool, stream)
        call("pool.cuStreamSynchronize", cu.cuStreamSynchronize, stream)
        call("pool.cuMemsetD32", cu.cuMemsetD32, ptr, POOL_PATTERN, SIZE // 4)
        pool_fd = int(call("pool.cuMemPoolExportToShareableHandle", cu.cuMemPoolExportToShareableHandle,
                           pool, posix, 0))
        export = call("pool.cuMemPoolExportPointer", cu.cuMemPoolExportPointer, ptr)
        # cuda-bindings 13.x keeps CUmemPoolPtrExportData opaque (no .reserved): read the 64-byte C struct.
        raw = getattr(export, "reserved", None)
        data = bytes(raw) if raw is not None else ctypes.string_at(export.getPtr(), 64)
        # (b) A VMM allocation exported as an FD, filled through a mapping that is gone again before we die.
        prop = cu.CUmemAllocationProp()
        prop.type, prop.requestedHandleTypes = pinned, posix
        prop.location.type, prop.location.id = device, 0
        gran = call("vmm.cuMemGetAllocationGranularity", cu.cuMemGetAllocationGranularity, prop,
                    cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)
        vsize = -(-SIZE // gran) * gran
        handle = call("vmm.cuMemCreate", cu.cuMemCreate, vsize, prop, 0)
        vmm_fd = int(call("vmm.cuMemExportToShareableHandle", cu.cuMemExportToShareableHandle, handle, posix, 0))
        va = _map(call, cu, "vmm", handle, vsize)
        call("vmm.cuMemsetD32", cu.cuMemsetD32, va, VMM_PATTERN, vsize // 4)
        call("vmm.cuCtxSynchronize", cu.cuCtxSynchronize)
        call("vmm.cuMemUnmap", cu.cuMemUnmap, va, vsize)     # no cuMemRelease: only the FD holds it now
        _send(sock, {"pool_size": SIZE, "export_data": data.hex(), "vmm_size": vsize}, (pool_fd, vmm_fd))
    except Exception as exc:  # noqa: BLE001 (whatever it is, the parent must hear it)
        ctl.send(("error", f"{type(exc).__name__}: {exc}"))
        os._exit(1)
    ctl.send(("sent", {"device": name, "driver": driver, "pid": os.getpid(), "vmm_size": vsize,
                       "granularity": gran, "export_data": data.hex()}))
    if wait_for_kill:
        time.sleep(3600)              # the parent SIGKILLs us here, the context still live
    cu.cuCtxSynchronize()
    os._exit(0)                       # no frees, no Python or atexit teardown: as near a crash as an exit gets


def keeper_main(ctl, from_exporter, to_adopter, timeout: float) -> None:
    got = _recv(from_exporter, timeout)   # no CUDA here, on purpose: systemd knows nothing of GPUs
    if got is None:
        ctl.send(("error", "the exporter closed its socket without sending"))
        return
    meta, fds = got
    ctl.send(("holding", len(fds)))
    if not ctl.poll(timeout) or ctl.recv() != "exporter_dead":
        return
    time.sleep(1)                     # let the driver finish whatever it does when an owner dies
    dups = [os.dup(fd) for fd in fds]
    _send(to_adopter, meta, dups)
    for fd in dups:
        os.close(fd)
    if ctl.poll(timeout):             # "release": the adopter is done with its own copies
        ctl.recv()
    for fd in fds:
        os.close(fd)


def adopter_main(ctl, sock, timeout: float) -> None:
    import faulthandler
    faulthandler.enable()             # a segfault prints the Python stack to stderr
    from cuda.bindings import driver as cu

    call = Steps(ctl, strict=False)
    try:
        got = _recv(sock, timeout)
        ok = got is not None and len(got[1]) == 2
        call.note("receive", "ok" if ok else f"no FDs from the keeper: {got!r}")
        if ok and _open_device(call, cu) is not FAIL:
            _adopt(call, cu, ctl, got[0], *got[1], timeout)
    except Exception as exc:  # noqa: BLE001 (a bug here must still reach the parent as a result)
        call.note("exception", f"{type(exc).__name__}: {exc}")
    ctl.send(("done",))


def _verify_and_write(call, cu, kind: str, ptr, size: int, pattern: int) -> None:
    """Check that the first and last PROBE bytes hold ``pattern``; write WRITE_PATTERN; check again."""
    host = (ctypes.c_uint32 * (PROBE // 4))()
    for group, want in ((f"{kind}.import", pattern), (f"{kind}.write", WRITE_PATTERN)):
        if want == WRITE_PATTERN and (call(f"{group}.cuMemsetD32", cu.cuMemsetD32, ptr, want, size // 4) is FAIL
                                      or call(f"{group}.cuCtxSynchronize", cu.cuCtxSynchronize) is FAIL):
            return
        for where, off in (("first", 0), ("last", size - PROBE)):
            key = f"{group}.read_{where}_4k"
            if call(key, cu.cuMemcpyDtoH, ctypes.addressof(host), cu.CUdeviceptr(int(ptr) + off), PROBE) is FAIL:
                return
            bad = [v for v in host if v != want]
            if bad:
                call.note(key, f"{len(bad)}/{len(host)} words differ, e.g. 0x{bad[0]:08x}")


def _adopt(call, cu, ctl, meta: dict, pool_fd: int, vmm_fd: int, timeout: float) -> None:
    posix = _enums(cu)[0]

    def free_mib(tag: str) -> None:   # device-wide free memory: shows when orphaned memory comes back
        r = call(f"free_mib.{tag}", cu.cuMemGetInfo)
        if r is not FAIL:
            call.note(f"free_mib.{tag}", round(int(r[0]) / MiB, 1))

    free_mib("start")
    # (a) The pool and its allocation, their creator dead.
    pool = call("pool.import.cuMemPoolImportFromShareableHandle", cu.cuMemPoolImportFromShareableHandle,
                pool_fd, posix, 0)
    ptr = FAIL
    if pool is not FAIL:
        data = cu.CUmemPoolPtrExportData()
        ctypes.memmove(data.getPtr(), bytes.fromhex(meta["export_data"]), 64)
        ptr = call("pool.import.cuMemPoolImportPointer", cu.cuMemPoolImportPointer, pool, data)
    if ptr is not FAIL:
        _verify_and_write(call, cu, "pool", ptr, meta["pool_size"], POOL_PATTERN)
    # (b) The VMM allocation: import, map, check, write, and give everything back.
    vsize = meta["vmm_size"]
    handle = call("vmm.import.cuMemImportFromShareableHandle", cu.cuMemImportFromShareableHandle, vmm_fd, posix)
    if handle is not FAIL:
        va = _map(call, cu, "vmm.import", handle, vsize)
        if va is not FAIL:
            _verify_and_write(call, cu, "vmm", va, vsize, VMM_PATTERN)
            call("vmm.release.cuMemUnmap", cu.cuMemUnmap, va, vsize)
            call("vmm.release.cuMemAddressFree", cu.cuMemAddressFree, va, vsize)
        call("vmm.release.cuMemRelease", cu.cuMemRelease, handle)
    free_mib("after_vmm_release")
    # (c1) An imported pool cannot allocate (documented); does it say so cleanly with its owner dead?
    stream = call("c1.cuStreamCreate", cu.cuStreamCreate, 0)
    if pool is not FAIL and stream is not FAIL:
        new = call("c1.cuMemAllocFromPoolAsync(imported pool)", cu.cuMemAllocFromPoolAsync, MiB, pool, stream)
        if new is not FAIL:           # unexpected: give it back
            call("c1.cuMemFreeAsync", cu.cuMemFreeAsync, new, stream)
            call("c1.cuStreamSynchronize", cu.cuStreamSynchronize, stream)
    # (c2) Is the memory returned, and when: at our frees, our FD closes, or only the keeper's exit?
    free_mib("before_pool_free")
    if ptr is not FAIL:
        call("pool.free.cuMemFree", cu.cuMemFree, ptr)
    if pool is not FAIL:
        call("pool.free.cuMemPoolDestroy", cu.cuMemPoolDestroy, pool)
    free_mib("after_pool_free")
    os.close(pool_fd)
    os.close(vmm_fd)
    free_mib("after_close_fds")
    ctl.send(("wait_keeper",))
    if ctl.poll(timeout) and ctl.recv() == "keeper_gone":
        time.sleep(1)                 # the driver's cleanup after the last reference may lag a little
        free_mib("after_keeper_exit")
