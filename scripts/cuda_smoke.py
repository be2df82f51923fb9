"""Backend-level CUDA smoke test: the broker backend in this process, clients in child processes.

No broker daemon, no sockets: the pool FD reaches each child through ``pass_fds`` and the exports
travel as hex on the child's stdin/stdout. Checks, in order:

1. cross-process data both ways: child A writes 0x5A, child B reads it zero-copy through torch
   (DLPack) and cupy (CUDA array interface), writes 0xA5, the parent reads 0xA5; A's release goes
   through ``add_release`` and B's done event through ``free`` (R2);
2. ordered free (R2): child C runs a ~1 s kernel that writes 0xCC at its end, releases on that
   stream and reports its done event at once; the parent frees with it, immediately reallocates the
   same size on the same session and fills 0xDD. All 0xDD means the free waited. The same with no
   done event (a negative control) should show 0xCC: proof that the check can fail;
3. a dead peer: a session stream waits on a done event of a child killed mid-kernel; report whether
   (and when) that stream moves on;
4. pool statistics, reset_high, trim, release threshold, reuse policies.

Prints one JSON document; exit status 0 when every check passed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np

MiB = 1 << 20


# ----------------------------------------------------------------------------- child side
def _child(role: str, fd: int) -> None:
    from cuda.core import Device

    from ipcpool.backend.base import Export
    from ipcpool.backend.cuda import CudaClientBackend

    def send(obj):
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    req = json.loads(sys.stdin.readline())
    backend = CudaClientBackend()
    pool = backend.import_pool(req["info"], os.dup(fd))
    os.close(fd)
    dev = Device(req["info"]["device"])
    dev.set_current()
    stream = dev.create_stream()
    exp = Export(size=req["size"], data=bytes.fromhex(req["data"]), ready_event=bytes.fromhex(req["ready"]))
    mem = pool.import_allocation(exp, stream)
    out: dict = {"role": role, "ptr": mem.ptr}
    if role == "A":
        mem.buffer.fill(0x5A, stream=stream)
        stream.sync()
    elif role == "B":
        import cupy
        import torch

        class View:  # what the client's Buffer exposes
            __cuda_array_interface__ = property(lambda self: mem.cuda_array_interface)

            def __dlpack__(self, **kw):
                return mem.dlpack(**kw)

            def __dlpack_device__(self):
                return mem.dlpack_device()

        stream.sync()
        t = torch.from_dlpack(View())
        out["torch_dtype"] = str(t.dtype)  # cuda.core exports bytes as int8
        t = t.view(torch.uint8)
        out["torch_ok"] = bool((t == 0x5A).all().item()) and t.data_ptr() == mem.ptr
        a = cupy.asarray(View())
        out["cupy_ok"] = bool((a == 0x5A).all().get()) and a.data.ptr == mem.ptr
        t.fill_(0xA5)
        torch.cuda.synchronize()
        del t, a
    elif role in ("C", "D"):
        import cupy

        from tests.gpu.kernels import SPIN_SRC

        k = cupy.RawKernel(SPIN_SRC, "spin_fill")
        cycles = int(req.get("cycles", 2_000_000_000))
        with cupy.cuda.ExternalStream(int(stream.handle)):
            k((264,), (256,), (np.uint64(mem.ptr), np.uint64(mem.size), np.int64(cycles), np.uint8(0xCC)))
    done = pool.release(mem, stream)
    out["done"] = done.hex()
    send(out)
    sys.stdin.readline()  # keep our done event alive until the parent has used it
    if role != "D":
        stream.sync()
    backend.close()
    pool.close()
    send({"role": role, "bye": True})


# ----------------------------------------------------------------------------- parent side
class Child:
    def __init__(self, role: str, pool, export, extra=None):
        fd = pool.fd
        self.p = subprocess.Popen(
            [sys.executable, __file__, "--child", role, "--fd", str(fd)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=(fd,), text=True,
        )
        req = {"info": pool.pool_info(), "size": export.size, "data": export.data.hex(),
               "ready": export.ready_event.hex(), **(extra or {})}
        self.p.stdin.write(json.dumps(req) + "\n")
        self.p.stdin.flush()

    def reply(self) -> dict:
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"child exited with {self.p.wait()}")
        return json.loads(line)

    def finish(self) -> int:
        try:
            self.p.stdin.write("go\n")
            self.p.stdin.flush()
        except BrokenPipeError:
            pass
        self.p.stdout.read()
        return self.p.wait(60)


def read_back(buf, n: int) -> np.ndarray:
    from cuda.bindings import driver as cu

    host = np.empty(n, dtype=np.uint8)
    err, = cu.cuMemcpyDtoH(host.ctypes.data, cu.CUdeviceptr(int(buf.handle)), n)
    assert err == cu.CUresult.CUDA_SUCCESS, err
    return host


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child")
    ap.add_argument("--fd", type=int)
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.child:
        _child(args.child, args.fd)
        return 0

    from ipcpool.backend.base import PoolSpec
    from ipcpool.backend.cuda import CudaBrokerBackend, capabilities

    res: dict = {"checks": {}}
    ok = res["checks"]
    t0 = time.perf_counter()
    res["capabilities"] = capabilities()
    backend = CudaBrokerBackend()
    pool = backend.create_pool(PoolSpec("default", max_size=4 << 30, release_threshold=None))
    res["pool_info"] = pool.pool_info()
    res["reuse"] = pool.reuse_policies()
    res["release_threshold"] = pool.release_threshold()
    session = backend.open_session()
    stream = session.stream(0)
    base = pool.stats()

    # 1. data both ways
    size = 64 * MiB
    h, exp = pool.allocate(size, session)
    ok["export_64_bytes"] = len(exp.data) == 64 and len(exp.ready_event) == 64
    a = Child("A", pool, exp)
    ra = a.reply()
    exp_b = pool.reexport(h, exp, backend.open_session())
    b = Child("B", pool, exp_b)
    pool.add_release(h, session, bytes.fromhex(ra["done"]))
    rb = b.reply()
    res["child_B"] = rb
    ok["torch_dlpack_sees_0x5A"] = rb.get("torch_ok")
    ok["cupy_cai_sees_0x5A"] = rb.get("cupy_ok")
    stream.sync()
    ok["parent_sees_0xA5"] = bool((read_back(h.buffer, size) == 0xA5).all())
    res["stats_while_held"] = pool.stats().as_dict()
    pool.free(h, session, bytes.fromhex(rb["done"]))
    ok["child_A_exit_0"] = a.finish() == 0
    ok["child_B_exit_0"] = b.finish() == 0
    pool.stats()                 # sweeps: B's done event completed, so the free runs now
    backend.reaper(0).sync()
    stream.sync()
    res["stats_after_free"] = pool.stats().as_dict()
    ok["used_back_to_base"] = pool.stats().used == base.used

    # 2. ordered free, and a negative control that must show the corruption. The pool holds one
    #    such buffer, so the second allocation must reuse the first one's memory.
    size = 256 * MiB
    tight = backend.create_pool(PoolSpec("tight", max_size=size + size // 2))
    for mode in ("ordered", "unordered"):
        h, exp = tight.allocate(size, session)
        c = Child("C", tight, exp, {"cycles": 2_000_000_000})
        rc = c.reply()
        t_free = time.perf_counter()
        tight.free(h, session, bytes.fromhex(rc["done"]) if mode == "ordered" else b"")
        host_free_s = time.perf_counter() - t_free
        from ipcpool.errors import OutOfMemory
        while True:
            try:
                h2, _ = tight.allocate(size, session)
                break
            except OutOfMemory:
                if time.perf_counter() - t_free > 30:
                    raise
                time.sleep(0.002)
        got_s = time.perf_counter() - t_free
        same = int(h2.buffer.handle) == int(h.buffer.handle)
        h2.buffer.fill(0xDD, stream=stream)
        c.finish()  # the child syncs its stream: its kernel is done
        stream.sync()
        data = read_back(h2.buffer, size)
        res[f"free_{mode}"] = {
            "same_pointer": same, "host_free_s": round(host_free_s, 5),
            "realloc_after_s": round(got_s, 3),
            "dd": int((data == 0xDD).sum()), "cc": int((data == 0xCC).sum()),
        }
        if mode == "ordered":
            ok["ordered_free_keeps_new_data"] = bool((data == 0xDD).all())
            ok["free_does_not_block_host"] = host_free_s < 0.05
        else:
            res["negative_control_detects_early_free"] = bool((data == 0xCC).any())
        tight.free(h2, session, b"")
        stream.sync()
    time.sleep(0.05)
    res["tight_stats_end"] = tight.stats().as_dict()
    tight.close()

    # 3. a dead peer's done event: does it ever complete? and peer_gone() lets the free go
    size = 16 * MiB
    used0 = pool.stats().used
    h, exp = pool.allocate(size, session)
    s2 = backend.open_session()
    d = Child("D", pool, exp, {"cycles": 6_000_000_000})
    rd = d.reply()
    pool.free(h, s2, bytes.fromhex(rd["done"]))
    t_kill = time.perf_counter()
    d.p.send_signal(signal.SIGKILL)
    d.p.wait()
    statuses = []
    while time.perf_counter() - t_kill < 8:
        waits = [w for a, _, _ in backend._frees._pending for w in a.waits]
        if not waits:
            statuses.append("settled")
            break
        try:
            statuses.append("done" if waits[0].marker.is_done else "pending")
        except Exception as exc:  # what does a dead exporter's event answer?
            statuses.append(f"error {exc}"[:120])
            break
        time.sleep(0.25)
    pending_before = backend.pending_frees
    s2.peer_gone()
    stream.sync()
    backend.reaper(0).sync()
    res["dead_peer"] = {"query_after_kill": sorted(set(statuses)), "pending_before_peer_gone": pending_before,
                        "pending_after": backend.pending_frees, "used_back": pool.stats().used == used0}
    ok["dead_peer_memory_comes_back"] = pool.stats().used == used0

    # 4. stats, trim, reset_high, threshold
    stream.sync()
    pool.set_release_threshold(0)
    res["threshold_after_set"] = pool.release_threshold()
    pool.set_release_threshold((1 << 64) - 1)
    before = pool.stats().as_dict()
    pool.trim(0)
    after = pool.stats().as_dict()
    pool.reset_high()
    reset = pool.stats().as_dict()
    res["trim"] = {"before": before, "after": after, "after_reset_high": reset}
    res["trim_releases_memory"] = after["reserved"] < before["reserved"]  # IPC pools: expected False
    ok["reset_high"] = reset["used_high"] == reset["used"] or reset["used_high"] <= before["used_high"]

    # above the import limit: VMM chunks, none over the limit, an FD each, gone after the free
    from ipcpool.backend.cuda import IMPORT_LIMIT
    big_pool = backend.create_pool(PoolSpec("unbounded"))   # the smoke pool's max_size bounds VMM too
    big, export = big_pool.allocate(8 << 30, session)
    fds = big_pool.chunk_fds(big)
    ok["8GiB_as_vmm_chunks"] = (sum(export.chunks) >= 8 << 30 and max(export.chunks) <= IMPORT_LIMIT
                                and len(fds) == len(export.chunks) and not export.data)
    used_big = big_pool.stats().used
    big_pool.free(big, session)
    backend.sweep()
    ok["8GiB_freed"] = big_pool.stats().used <= used_big - (8 << 30)

    session.close()
    s2.close()
    pool.close()
    big_pool.close()
    backend.close()
    res["seconds"] = round(time.perf_counter() - t0, 2)
    res["passed"] = all(bool(v) for v in ok.values())
    text = json.dumps(res, indent=1, default=str)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = main()
    sys.stdout.flush()
    os._exit(code)  # never hang in CUDA teardown on a stream that waits on a dead process
