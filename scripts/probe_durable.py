"""Does CUDA memory outlive the process that made it, when another process keeps its FDs?

A crash-tolerant broker needs this: the broker dies, systemd's FD store keeps the FDs it exported,
a restarted broker adopts the memory. Three 'spawn' processes, joined by AF_UNIX SEQPACKET
socketpairs that carry the FDs by SCM_RIGHTS:

  EXPORTER  the old broker: an IPC pool allocation (0xA5A5A5A5) and a VMM allocation (0x5A5A5A5A),
            exported as POSIX FDs and sent to the KEEPER; then it dies without freeing anything,
            by os._exit(0) (variant "exit") or by the parent's SIGKILL (variant "kill").
  KEEPER    systemd's FD store: no CUDA. Holds the FDs across the death, passes duplicates on.
  ADOPTER   the restarted broker: imports both, checks the patterns, writes and reads back, tries a
            new allocation from the imported pool, frees, and follows cuMemGetInfo until the
            keeper's copies are gone too.

Each adopter step is announced to the parent before it runs and its outcome ("ok", the CUresult
name, or the exception) after, so a segfault leaves the step it died in, next to the exit code.
Every wait has a timeout. cuda.bindings is imported inside the roles: --help needs no GPU.

    python scripts/probe_durable.py                       # both variants, JSON in bench/results/
    python scripts/probe_durable.py --variant kill --out /tmp/durable.json
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import multiprocessing as mp
import os
import re
import signal
import socket
import subprocess
import sys
import time

MiB = 1 << 20
GiB = 1 << 30
SIZE = 64 * MiB
PROBE = 4096                      # bytes read back at each end of an allocation
POOL_PATTERN, VMM_PATTERN, WRITE_PATTERN = 0xA5A5A5A5, 0x5A5A5A5A, 0x11111111
FAIL = object()                   # a failed call; None is a legitimate result (cuMemsetD32 etc.)
RESULTS = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench", "results"))


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


# ----------------------------------------------------------------------------------------- parent

def _wait(conn, kinds: set, steps: dict, timeout: float) -> tuple:
    """Read (kind, ...) messages until one of ``kinds``; steps go to ``steps``. ("timeout",)/("eof",)."""
    while True:
        if not conn.poll(timeout):
            return ("timeout",)
        try:
            msg = conn.recv()
        except EOFError:              # the child is gone (crash, or it exited early)
            return ("eof",)
        if msg[0] == "step":
            steps[msg[1]] = msg[2]
        elif msg[0] in kinds:
            return msg


def _join(p, timeout: float):
    p.join(timeout)
    if p.is_alive():
        p.kill()
        p.join(5)
        return f"hung after {timeout:.0f} s, killed"
    code = p.exitcode
    return f"{code} ({signal.strsignal(-code)})" if code is not None and code < 0 else code


def run_variant(variant: str, timeout: float) -> dict:
    ctx = mp.get_context("spawn")
    out = {"variant": variant, "exporter": {"steps": {}}, "keeper": {"steps": {}}, "adopter": {"steps": {}}}
    pipes = {r: ctx.Pipe() for r in out if r != "variant"}
    ctl = {r: pipes[r][0] for r in pipes}
    ek = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ka = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    procs = {
        "exporter": ctx.Process(target=exporter_main, args=(pipes["exporter"][1], ek[0], variant == "kill")),
        "keeper": ctx.Process(target=keeper_main, args=(pipes["keeper"][1], ek[1], ka[0], timeout)),
        "adopter": ctx.Process(target=adopter_main, args=(pipes["adopter"][1], ka[1], timeout)),
    }

    def start(role: str, *socks) -> None:
        procs[role].start()
        for end in (pipes[role][1], *socks):  # our copies must go, or a dead child never reads as EOF
            end.close()

    try:
        start("keeper", ek[1], ka[0])
        start("exporter", ek[0])
        for role, kind in (("exporter", "sent"), ("keeper", "holding")):
            msg = _wait(ctl[role], {kind, "error"}, out[role]["steps"], timeout)
            out[role]["status"] = f"error: {msg[1]}" if msg[0] == "error" else msg[0]
            if msg[0] != kind:
                return out
            if role == "exporter":
                out["exporter"].update(msg[1])
        if variant == "kill":
            os.kill(procs["exporter"].pid, signal.SIGKILL)
        out["exporter"]["exitcode"] = _join(procs["exporter"], timeout)   # dead before anyone adopts
        ctl["keeper"].send("exporter_dead")
        start("adopter", ka[1])
        steps = out["adopter"]["steps"]
        while (msg := _wait(ctl["adopter"], {"wait_keeper", "done"}, steps, timeout))[0] == "wait_keeper":
            ctl["keeper"].send("release")                 # the FD store lets go of the last copies
            out["keeper"]["exitcode"] = _join(procs["keeper"], timeout)
            ctl["adopter"].send("keeper_gone")
        out["adopter"]["status"] = msg[0]
        out["adopter"]["last_step"] = next(reversed(steps), None)
    finally:
        for role, p in procs.items():                       # nothing may outlive the probe
            if p.pid is not None and "exitcode" not in out[role]:
                if role == "keeper" and p.is_alive():
                    try:
                        ctl["keeper"].send("release")
                    except OSError:
                        pass
                out[role]["exitcode"] = _join(p, 5 if role == "exporter" else timeout)
        for end in (*ek, *ka):
            end.close()
    return out


def _summary(run: dict) -> dict:
    """Exit codes, then each adopter step group's first failure, then free memory against the start."""
    rows = {f"{r} exit": run[r].get("exitcode", "not started") for r in ("exporter", "keeper", "adopter")}
    if run["exporter"].get("status", "").startswith("error"):
        rows["exporter exit"] = run["exporter"]["status"]
    steps, groups = run["adopter"]["steps"], {}
    for key, value in steps.items():
        if not key.startswith("free_mib."):
            group, _, what = key.rpartition(".")
            if groups.get(group or key, "ok") == "ok":   # keep the group's first failure
                groups[group or key] = "ok" if value == "ok" else f"CRASHED in {what}" if value == "started" \
                    else f"{what}: {value}"
    rows.update(groups)
    start = steps.get("free_mib.start")
    for key, value in steps.items():
        if key.startswith("free_mib.") and key != "free_mib.start":
            ok = isinstance(value, float) and isinstance(start, float)
            rows[f"free MiB vs start, {key[9:]}"] = f"{value - start:+.1f}" if ok else value
    return rows


def _nvidia_smi() -> tuple[str | None, str | None]:
    try:
        p = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader", "-i", "0"],
                           capture_output=True, text=True, timeout=30, check=False)
        name, version = (s.strip() for s in p.stdout.strip().splitlines()[0].split(","))
        return name, version
    except Exception:  # noqa: BLE001 (no nvidia-smi, or odd output: the JSON says null)
        return None, None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", choices=("exit", "kill", "both"), default="both",
                    help="how the exporter dies: os._exit(0), SIGKILL, or both one after the other")
    ap.add_argument("--out", help="JSON path (default bench/results/durable_probe_<device>_<date>.json)")
    ap.add_argument("--timeout", type=float, default=60, help="seconds for every wait on a child")
    args = ap.parse_args()

    runs = {}
    for v in (("exit", "kill") if args.variant == "both" else (args.variant,)):
        print(f"variant {v}: the exporter dies by {'os._exit(0)' if v == 'exit' else 'SIGKILL'}", flush=True)
        runs[v] = run_variant(v, args.timeout)
        runs[v]["summary"] = _summary(runs[v])
    smi_name, smi_driver = _nvidia_smi()
    exp = next((r["exporter"] for r in runs.values() if "device" in r["exporter"]), {})
    name = exp.get("device") or smi_name or "unknown"
    now = datetime.datetime.now(datetime.UTC)
    out = {"what": "CUDA pool and VMM memory kept alive by FDs another process holds after its creator died",
           "device": name, "driver": exp.get("driver"), "driver_version": smi_driver,
           "date": now.isoformat(timespec="seconds"), "variant": args.variant, "size": SIZE, "runs": runs}

    rows = list(dict.fromkeys(k for r in runs.values() for k in r["summary"]))
    cells = {v: [str(r["summary"].get(k, "-"))[:64] for k in rows] for v, r in runs.items()}
    widths = {v: max(len(v), *map(len, c)) + 2 for v, c in cells.items()}
    print("".ljust(max(map(len, rows)) + 2) + "".join(v.ljust(widths[v]) for v in runs))
    for i, row in enumerate(rows):
        print(row.ljust(max(map(len, rows)) + 2) + "".join(cells[v][i].ljust(widths[v]) for v in runs))

    slug = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_").removeprefix("nvidia_")
    path = args.out or os.path.join(RESULTS, f"durable_probe_{slug}_{now:%Y%m%d}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
