"""Re-measure the broker's reliability figures on the host backend.

Three runs against one fresh broker, each with a progress bar and figures at the end:

  kills     N client processes, one after another, each connects, allocates 1 MiB (written), starts
            an object it never seals, and is SIGKILLed; how long until the broker has reclaimed
            all of it (its sessions and pool use back to the baseline), p50/p99; the broker's
            open FDs and RSS before and after.
  clients   P client processes at once, each running C cycles (allocate, write, check, free; every
            tenth cycle also create, seal, get, check, delete an object); errors counted. Each
            client's arena is 1 MiB (--arena-bytes): 256 clients with the default 32 MiB arenas
            hold the whole default 8 GiB host pool, and allocations then fail with OutOfMemory.
  sessions  S sessions opened and closed one after another; the broker's FDs and RSS before,
            during and after.

    python bench/reliability.py                                   # 1000 kills, 256 x 200, 10,000 sessions
    python bench/reliability.py --kills 100 --procs 32 --cycles 50 --sessions 1000    # quick
    python bench/reliability.py --json out.json

Client processes are forked from this one (ipcpool already imported), so starting one costs
about a millisecond and what is measured is the broker.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ipcpool  # noqa: E402
from bench.common import broker, machine  # noqa: E402
from ipcpool.progress import Progress  # noqa: E402

MiB = 1 << 20


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def fork(child) -> int:
    """Run ``child()`` in a forked process that never returns here; exit 0 if it returns."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            warnings.simplefilter("ignore")
            child()
            code = 0
        except BaseException as exc:   # report, then leave without running the parent's clean-up
            print(f"child {os.getpid()}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        finally:
            os._exit(code)
    return pid


# -- kills ------------------------------------------------------------------------------------------
def run_kills(sd: Path, n: int) -> dict:
    with ipcpool.connect(sd) as watch:
        bpid = watch.stats()["pid"]
        base = watch.stats()
        fds0, rss0 = fds(bpid), rss_kib(bpid)
        times, stuck = [], 0
        with Progress("kill -9 clients", n) as bar:
            for i in range(n):
                r, w = os.pipe()

                def child(i=i, w=w):
                    c = ipcpool.connect(sd, arena_bytes=0)
                    buf = c.allocate(MiB)
                    buf.view[:] = b"\xa5" * MiB
                    c.create(f"rel/kill/{i}", 4096)
                    os.write(w, b"r")
                    signal.pause()

                pid = fork(child)
                os.close(w)
                assert os.read(r, 1) == b"r", "the client did not get ready"
                os.close(r)
                t0 = time.perf_counter()
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                deadline = t0 + 10
                while True:
                    s = watch.stats()
                    if (s["sessions"], s["pools"]["default"]["used"], s["objects"]) == (
                            base["sessions"], base["pools"]["default"]["used"], base["objects"]):
                        times.append(time.perf_counter() - t0)
                        break
                    if time.perf_counter() > deadline:
                        stuck += 1
                        break
                bar.update()
        fds1, rss1 = fds(bpid), rss_kib(bpid)
    return {"clients": n, "reclaimed": len(times), "not_reclaimed_in_10s": stuck,
            "reclaim_p50_ms": round(pct(times, 0.5) * 1e3, 2), "reclaim_p99_ms": round(pct(times, 0.99) * 1e3, 2),
            "reclaim_max_ms": round(max(times) * 1e3, 2) if times else None,
            "broker_fds_before": fds0, "broker_fds_after": fds1, "broker_rss_kib_before": rss0,
            "broker_rss_kib_after": rss1}


# -- many clients at once ---------------------------------------------------------------------------
def client_cycles(sd: Path, cycles: int, tag: int, arena_bytes: int) -> None:
    import numpy as np

    with ipcpool.connect(sd, timeout=60, arena_bytes=arena_bytes) as c:
        for k in range(cycles):
            size = 4096 << (k % 8)
            with c.allocate(size) as buf:
                a = np.asarray(buf)
                a[:] = (tag + k) % 251
                if not (a[::512] == (tag + k) % 251).all():
                    raise AssertionError("memory does not hold what was written")
            if k % 10 == 0:
                name = f"rel/c/{tag}/{k}"
                buf = c.create(name, 4096)
                np.asarray(buf)[:] = k % 256
                buf.seal()
                buf.free()
                lease = c.get(name, timeout=30)
                if np.asarray(lease)[0] != k % 256:
                    raise AssertionError("object does not hold what was written")
                lease.free()
                c.delete(name)


def run_clients(sd: Path, procs: int, cycles: int, arena_bytes: int) -> dict:
    with ipcpool.connect(sd) as watch:
        bpid = watch.stats()["pid"]
        fds0, rss0 = fds(bpid), rss_kib(bpid)
        t0 = time.perf_counter()
        pids = [fork(lambda t=t: client_cycles(sd, cycles, t, arena_bytes)) for t in range(procs)]
        failed = 0
        with Progress(f"{procs} clients x {cycles}", procs) as bar:
            for pid in pids:
                _, status = os.waitpid(pid, 0)
                failed += os.waitstatus_to_exitcode(status) != 0
                bar.update()
        seconds = time.perf_counter() - t0
        deadline = time.monotonic() + 10
        while watch.stats()["sessions"] > 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        s = watch.stats()
        return {"processes": procs, "cycles_each": cycles, "arena_bytes": arena_bytes, "failed_processes": failed,
                "seconds": round(seconds, 2), "sessions_after": s["sessions"],
                "used_after": s["pools"]["default"]["used"], "objects_after": s["objects"],
                "broker_fds_before": fds0, "broker_fds_after": fds(bpid),
                "broker_rss_kib_before": rss0, "broker_rss_kib_after": rss_kib(bpid)}


# -- sessions one after another ---------------------------------------------------------------------
def run_sessions(sd: Path, n: int) -> dict:
    with ipcpool.connect(sd) as watch:
        bpid = watch.stats()["pid"]
        fds0, rss0 = fds(bpid), rss_kib(bpid)
        samples = []
        t0 = time.perf_counter()
        with Progress("sessions", n) as bar:
            for i in range(n):
                with ipcpool.connect(sd, arena_bytes=0) as c:
                    c.stats()
                if (i + 1) % max(1, n // 10) == 0:
                    samples.append(fds(bpid))
                bar.update()
        seconds = time.perf_counter() - t0
        deadline = time.monotonic() + 5   # the last session's sockets close a moment after it
        while fds(bpid) > fds0 and time.monotonic() < deadline:
            time.sleep(0.01)
        return {"sessions": n, "seconds": round(seconds, 2), "per_session_ms": round(seconds / n * 1e3, 3),
                "broker_fds_before": fds0, "broker_fds_samples": samples, "broker_fds_after": fds(bpid),
                "broker_rss_kib_before": rss0, "broker_rss_kib_after": rss_kib(bpid),
                "sessions_after": watch.stats()["sessions"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=1000)
    ap.add_argument("--procs", type=int, default=256)
    ap.add_argument("--cycles", type=int, default=200)
    ap.add_argument("--sessions", type=int, default=10_000)
    ap.add_argument("--arena-bytes", type=int, default=1 << 20,
                    help="each concurrent client's arena (the default 32 MiB x 256 clients fills an 8 GiB pool)")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    out = {"machine": machine(), "args": vars(args)}
    with broker("host") as sd:
        if args.kills:
            out["kills"] = run_kills(sd, args.kills)
            print(json.dumps(out["kills"]))
        if args.procs and args.cycles:
            out["clients"] = run_clients(sd, args.procs, args.cycles, args.arena_bytes)
            print(json.dumps(out["clients"]))
        if args.sessions:
            out["sessions"] = run_sessions(sd, args.sessions)
            print(json.dumps(out["sessions"]))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    k, c, s = out.get("kills"), out.get("clients"), out.get("sessions")
    ok = True
    if k:
        print(f"kill -9: {k['reclaimed']}/{k['clients']} reclaimed, p50 {k['reclaim_p50_ms']} ms, "
              f"p99 {k['reclaim_p99_ms']} ms; broker FDs {k['broker_fds_before']} -> {k['broker_fds_after']}, "
              f"RSS {k['broker_rss_kib_before']} -> {k['broker_rss_kib_after']} KiB")
        ok &= k["reclaimed"] == k["clients"]
    if c:
        print(f"clients: {c['processes']} processes x {c['cycles_each']} cycles in {c['seconds']} s, "
              f"{c['failed_processes']} failed; after: {c['sessions_after']} session(s), {c['used_after']} bytes used")
        ok &= c["failed_processes"] == 0
    if s:
        print(f"sessions: {s['sessions']} in {s['seconds']} s ({s['per_session_ms']} ms each); broker FDs "
              f"{s['broker_fds_before']} -> {s['broker_fds_after']} (samples {s['broker_fds_samples']}), "
              f"RSS {s['broker_rss_kib_before']} -> {s['broker_rss_kib_after']} KiB")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
