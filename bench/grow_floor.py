"""The floor under growing a shared buffer, beside ipcpool and in-process VMM, step by step in one run.

The floor is what a grow shared across processes does at least, with nothing of ipcpool between:
a server process holds chunks made and exported ahead (as the broker's stock is) and answers one
AF_UNIX SEQPACKET request per step (msgpack). The client:

    create  sends the request, reserves its address range while the server answers, then imports
            the chunk's FD from the answer, maps it and sets access. The answer also carries the
            FDs of every later step's chunk (as ipcpool's create lends the stock).
    step    sends the request, and imports, maps and sets access of the chunk it holds the FD of
            while the server answers, then reads the answer (as ipcpool's grow from its loan).

ipcpool's series is a growable buffer created and doubled under a broker whose stock holds
``--stock``; vmm's is ``bench/vmm_grow.py``'s VMM in one process. Each runs ``--repeat`` series in
one fresh process: the first (the process's first create) is kept apart, and each step's median
over the others is reported. Every step ends with cuCtxSynchronize, as in vmm_grow.

    python bench/grow_floor.py [--max-gib 8] [--repeat 5] [--stock 8G]

Writes bench/results/grow_floor_<date>.json and a PNG beside it.
"""

from __future__ import annotations

import argparse
import array
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import broker, gpu_device, machine, progress, save  # noqa: E402
from bench.vmm_grow import Vmm, check, doubling, human  # noqa: E402

SPAN = 80 << 30   # address space a create reserves (ipcpool reserves the device's memory)


def _context():
    from cuda.bindings import driver as cu

    check(cu.cuInit(0))
    check(cu.cuCtxSetCurrent(check(cu.cuDevicePrimaryCtxRetain(check(cu.cuDeviceGet(0))))))
    return cu


def _send(sock: socket.socket, msg: dict, fds: list[int] = ()) -> None:
    import msgpack

    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sock.sendmsg([msgpack.packb(msg)], anc)


def _recv(sock: socket.socket) -> tuple[dict, list[int]]:
    import msgpack

    data, anc, _, _ = sock.recvmsg(4096, socket.CMSG_SPACE(64 * 4))
    fds = array.array("i")
    for _, _, payload in anc:
        fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    return msgpack.unpackb(data), list(fds)


def floor_server(sock: socket.socket, steps: list[int]) -> None:
    """Chunks of each step's size, made and exported before the client asks (a stock)."""
    cu = _context()
    vmm = Vmm(cu)
    posix = vmm.prop.requestedHandleTypes
    fds = [check(cu.cuMemExportToShareableHandle(check(cu.cuMemCreate(n, vmm.prop, 0)), posix, 0)) for n in steps]
    _send(sock, {"ready": True})
    while True:
        try:
            msg, _ = _recv(sock)
        except (ConnectionError, ValueError):
            return
        if msg.get("op") == "create":
            _send(sock, {"ok": True}, fds)   # the first chunk's, then the later steps' (lent)
        elif msg.get("op") == "grow":
            _send(sock, {"ok": True, "step": msg["i"]})
        else:
            return


def floor_series(cu, sock: socket.socket, steps: list[int], access) -> list[float]:
    posix = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    out, handles = [], []
    t0 = time.perf_counter()
    _send(sock, {"op": "create"})
    base = int(check(cu.cuMemAddressReserve(SPAN, steps[0], 0, 0)))   # while the server answers
    _, fds = _recv(sock)
    at = base
    for i, n in enumerate(steps):
        if i:
            t0 = time.perf_counter()
            _send(sock, {"op": "grow", "i": i})
        h = check(cu.cuMemImportFromShareableHandle(fds[i], posix))
        check(cu.cuMemMap(at, n, 0, h, 0))
        check(cu.cuMemSetAccess(at, n, access, 1))
        if i:
            _recv(sock)
        check(cu.cuCtxSynchronize())
        out.append((time.perf_counter() - t0) * 1e6)
        handles.append((at, n, h))
        at += n
    for at, n, h in handles:
        check(cu.cuMemUnmap(at, n))
        check(cu.cuMemRelease(h))
    check(cu.cuMemAddressFree(base, SPAN))
    for fd in fds:
        os.close(fd)
    return out


def run_floor(steps: list[int], repeat: int) -> list[list[float]]:
    ctx = mp.get_context("spawn")
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server = ctx.Process(target=floor_server, args=(theirs, steps))
    server.start()
    theirs.close()
    try:
        cu = _context()
        access = Vmm(cu).access
        _recv(mine)   # ready
        return [floor_series(cu, mine, steps, access) for _ in range(repeat)]
    finally:
        _send(mine, {"op": "stop"})
        mine.close()
        server.join(30)


class _NoMeter:
    def sample(self) -> None:
        pass


def vmm_child(sizes: list[int], repeat: int, conn) -> None:
    cu = _context()
    runs = []
    for _ in range(repeat):
        vmm, out = Vmm(cu), []
        for size in sizes:
            t0 = time.perf_counter()
            vmm.grow(size, _NoMeter())
            check(cu.cuCtxSynchronize())
            out.append((time.perf_counter() - t0) * 1e6)
        vmm.close()
        runs.append(out)
    conn.send(runs)


def ipcpool_child(sizes: list[int], repeat: int, sock: str, conn) -> None:
    import ipcpool

    cu = _context()
    client, runs = ipcpool.connect(sock), []
    full = _stock(client)
    for r in range(repeat):
        _stock_made(client, full)
        out, g = [], None
        for size in sizes:
            t0 = time.perf_counter()
            if g is None:
                g = client.create_growable(f"bench/floor-{r}", size)
            else:
                g.grow(size)
            check(cu.cuCtxSynchronize())
            out.append((time.perf_counter() - t0) * 1e6)
        g.close()
        client.delete_growable(f"bench/floor-{r}")
        runs.append(out)
    client.close()
    conn.send(runs)


def _stock(client) -> int:
    return client.stats()["pools"]["default"].get("stock_bytes", 0)


def _stock_made(client, full: int, wait_s: float = 30.0) -> None:
    """Until the broker's stock holds ``full`` bytes again (a series' loan ends with its buffer,
    and the broker makes the stock again once quiet)."""
    deadline = time.monotonic() + wait_s
    while _stock(client) < full and time.monotonic() < deadline:
        time.sleep(0.05)


def in_child(target, *args) -> list[list[float]]:
    ctx = mp.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    p = ctx.Process(target=target, args=(*args, send))
    p.start()
    send.close()
    try:
        return recv.recv()
    finally:
        p.join(60)


def summary(runs: list[list[float]]) -> dict:
    warm = runs[1:] or runs
    steps = [statistics.median(col) for col in zip(*warm)]
    return {"first_series_us": [round(x, 1) for x in runs[0]], "steps_us": [round(x, 1) for x in steps],
            "total_ms": round(sum(steps) / 1000, 3), "first_series_total_ms": round(sum(runs[0]) / 1000, 3),
            "series": len(runs)}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    x = [s / (1 << 20) for s in result["sizes"]]
    for name, res in result["methods"].items():
        ax.plot(x, res["steps_us"], "o-", ms=3, label=f"{name} (total {res['total_ms']:.2f} ms)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("buffer size after the step (MiB)")
    ax.set_ylabel("step time, median of warm series (µs)")
    ax.set_title(f"grow by doubling: the floor, ipcpool and VMM, {result['info']['device']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-gib", type=float, default=8.0)
    ap.add_argument("--start-mib", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5, help="series per method (the first is kept apart)")
    ap.add_argument("--stock", default="8G", help="the broker's chunk stock ([growth] stock); '' for the default")
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args(argv)
    sizes = doubling(args.start_mib, args.max_gib)
    if len(sizes) < 2 or args.repeat < 1:
        ap.error("need at least two sizes and one series")
    steps = [sizes[0]] + [b - a for a, b in zip(sizes, sizes[1:])]

    result: dict = {"benchmark": "grow_floor", "machine": machine(), "info": gpu_device(), "sizes": sizes,
                    "repeat": args.repeat, "stock": args.stock, "methods": {}}
    progress(f"device {result['info']}; {human(sizes[0])} to {human(sizes[-1])}, {args.repeat} series each")
    progress("floor (two processes, no ipcpool)")
    result["methods"]["floor"] = summary(run_floor(steps, args.repeat))
    progress("ipcpool")
    config = f'[growth]\nstock = "{args.stock}"\n' if args.stock else None
    with broker("cuda", config) as sock:
        result["methods"]["ipcpool"] = summary(in_child(ipcpool_child, sizes, args.repeat, str(sock)))
    progress("vmm (one process)")
    result["methods"]["vmm"] = summary(in_child(vmm_child, sizes, args.repeat))

    stem = f"grow_floor_{time.strftime('%Y%m%d-%H%M%S')}"
    save(stem, result, plot, Path(args.out_dir))
    m = result["methods"]
    print(f"\n{'size':>10}{'floor µs':>10}{'ipcpool µs':>12}{'vmm µs':>9}{'ipcpool/floor':>15}")
    for i, s in enumerate(sizes):
        f, ip, v = (m[k]["steps_us"][i] for k in ("floor", "ipcpool", "vmm"))
        print(f"{human(s):>10}{f:>10.0f}{ip:>12.0f}{v:>9.0f}{ip / f:>15.2f}")
    print(f"{'total ms':>10}{m['floor']['total_ms']:>10.2f}{m['ipcpool']['total_ms']:>12.2f}{m['vmm']['total_ms']:>9.2f}"
          f"{m['ipcpool']['total_ms'] / m['floor']['total_ms']:>15.2f}")
    print("first series (a fresh process's first create) ms: "
          + ", ".join(f"{k} {v['first_series_total_ms']:.2f}" for k, v in m.items()))
    print(f"wrote {Path(args.out_dir) / stem}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
