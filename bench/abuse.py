"""Re-measure how the broker holds under abuse (issue 31), on the host backend; one line each.

  rss        broker RSS idle, then with two sessions that each ask for N large replies (a list
             page of objects with ~55 KB of metadata each) and never read them.
  quiet      honest clients for D seconds: each cycle connects (p50/p99), and hands an object
             off (a writer's create+seal -> this reader's get), errors counted.
  idle       the same, during 1,000 control connections that never say hello (reopened as the
             broker drops them).
  bare       the same, during 100 bare ZeroMQ connections (no session) that send requests.
  watches    the same, while a session holds 4,096 watches on "" and never reads.
  pipeline   20,000 create+seal sent without waiting, then flush: seconds, errors.

    python bench/abuse.py                      # the whole run, a few minutes on 2 cores
    python bench/abuse.py --seconds 2 --replies 200 --pipeline 5000     # quick

Writes bench/results/abuse_host_<date>.json with the machine's description.
"""

from __future__ import annotations

import argparse
import socket
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zmq  # noqa: E402

import ipcpool  # noqa: E402
from bench.common import broker, machine, write_json  # noqa: E402
from ipcpool import fdpass, paths, protocol  # noqa: E402

BIG_META = {"user": {f"k{i}": "x" * 900 for i in range(60)}}


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def broker_pid(socket_dir: Path) -> int:
    return int((socket_dir / paths.LOCK_NAME).read_text().split()[0])


def pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- attackers --------------------------------------------------------------------------------
class NonReader:
    """A session opened by hand whose DEALER never reads (its own queue holds one message)."""

    def __init__(self, socket_dir: Path, ctx: zmq.Context):
        self.control = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.control.connect(str(socket_dir / paths.CONTROL_NAME))
        fdpass.send(self.control, {"op": "hello", "version": protocol.PROTOCOL_VERSION})
        hello, _ = fdpass.recv(self.control)
        self.dealer = ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.IDENTITY, hello["token"])
        self.dealer.setsockopt(zmq.RCVHWM, 1)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.connect(hello["endpoint"])

    def ask(self, n: int) -> None:
        for i in range(n):
            self.dealer.send(protocol.pack({"op": "list", "id": i + 1, "prefix": "big/"}))

    def close(self) -> None:
        self.dealer.close()
        self.control.close()


class IdleConnections:
    """``n`` control connections that never say hello, reopened as the broker drops them."""

    def __init__(self, socket_dir: Path, n: int):
        self.path = str(socket_dir / paths.CONTROL_NAME)
        self.socks = [self._open() for _ in range(n)]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._renew, daemon=True)
        self.thread.start()

    def _open(self) -> socket.socket | None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.setblocking(False)
        try:
            s.connect(self.path)
        except OSError:
            s.close()
            return None
        return s

    def _renew(self) -> None:
        while not self.stop.wait(0.2):
            for i, s in enumerate(self.socks):
                if s is None:
                    self.socks[i] = self._open()
                    continue
                try:
                    gone = s.recv(1, socket.MSG_PEEK) == b""
                except BlockingIOError:
                    gone = False
                except OSError:
                    gone = True
                if gone:
                    s.close()
                    self.socks[i] = self._open()

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        for s in self.socks:
            if s is not None:
                s.close()


class BareZmq:
    def __init__(self, socket_dir: Path, n: int, ctx: zmq.Context):
        self.socks = []
        for _ in range(n):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(f"ipc://{socket_dir / paths.ZMQ_NAME}")
            s.send(protocol.pack({"op": "ping", "id": 1}))
            self.socks.append(s)

    def close(self) -> None:
        for s in self.socks:
            s.close()


# -- honest clients -------------------------------------------------------------------------------
def honest(socket_dir: Path, seconds: float) -> dict:
    """Connect + hand-off cycles for ``seconds``: latencies in ms and errors."""
    connects, handoffs, errors = [], [], []
    with ipcpool.connect(socket_dir, timeout=5) as writer:
        deadline = time.monotonic() + seconds
        i = 0
        while time.monotonic() < deadline:
            i += 1
            try:
                t0 = time.perf_counter()
                with ipcpool.connect(socket_dir, timeout=5) as reader:
                    reader.stats()
                    t1 = time.perf_counter()
                    buf = writer.create(f"h/{i}", 4096)
                    buf.seal()
                    got = reader.get(f"h/{i}", timeout=5)
                    t2 = time.perf_counter()
                    reader.release(got)
                writer.delete(f"h/{i}")
                connects.append((t1 - t0) * 1e3)
                handoffs.append((t2 - t1) * 1e3)
            except ipcpool.IpcPoolError as exc:
                errors.append(f"{type(exc).__name__}: {exc}"[:200])
    return {"cycles": i, "errors": len(errors), "first_errors": errors[:3],
            "connect_ms": {"p50": pct(connects, 0.5), "p99": pct(connects, 0.99)},
            "handoff_ms": {"p50": pct(handoffs, 0.5), "p99": pct(handoffs, 0.99)}}


def line(name: str, r: dict, quiet: dict | None) -> str:
    text = (f"{name:8s} connect p50/p99 {r['connect_ms']['p50']:.2f}/{r['connect_ms']['p99']:.2f} ms, "
            f"hand-off p50/p99 {r['handoff_ms']['p50']:.2f}/{r['handoff_ms']['p99']:.2f} ms, "
            f"{r['cycles']} cycles, {r['errors']} errors")
    if quiet is not None:
        text += (f" (p99 x{r['connect_ms']['p99'] / quiet['connect_ms']['p99']:.2f} connect, "
                 f"x{r['handoff_ms']['p99'] / quiet['handoff_ms']['p99']:.2f} hand-off against quiet)")
    return text


# -- the runs -------------------------------------------------------------------------------------
def run_rss(socket_dir: Path, replies: int, ctx: zmq.Context) -> dict:
    pid = broker_pid(socket_dir)
    with ipcpool.connect(socket_dir, timeout=30) as c:
        for i in range(100):
            c.create(f"big/{i:04d}", 512, meta=BIG_META).seal()
        c.flush()
        c.stats()
    idle = rss_mib(pid)
    attackers = [NonReader(socket_dir, ctx) for _ in range(2)]
    try:
        for k, a in enumerate(attackers):
            say(f"  rss: session {k + 1} asks for {replies} replies of ~5.5 MB and reads none")
            a.ask(replies)
        with ipcpool.connect(socket_dir, timeout=120) as c:   # answered once the broker got to it
            c.stats()
        time.sleep(1.0)
        loaded = rss_mib(pid)
    finally:
        for a in attackers:
            a.close()
    return {"idle_mib": idle, "loaded_mib": loaded, "ratio": loaded / idle, "replies_each": replies}


def run_pipeline(socket_dir: Path, n: int) -> dict:
    with ipcpool.connect(socket_dir, timeout=60) as c:
        t0 = time.perf_counter()
        errors = 0
        try:
            for i in range(n):
                c.create(f"p/{i:06d}", 512).seal()
                if i % 5000 == 4999:
                    say(f"  pipeline: {i + 1}/{n} sent")
            c.flush()
        except ipcpool.IpcPoolError as exc:
            errors += 1
            say(f"  pipeline failed: {exc}")
        seconds = time.perf_counter() - t0
        errors += len(c.async_errors)
        objects = c.stats()["objects"]
    return {"creates": n, "seconds": seconds, "errors": errors, "objects": objects}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=5.0, help="each honest run (default 5)")
    ap.add_argument("--replies", type=int, default=1000, help="large replies each non-reading session asks for")
    ap.add_argument("--pipeline", type=int, default=20000, help="pipelined create+seal")
    ap.add_argument("--json", type=Path, default=None, help="where to write (default bench/results/)")
    args = ap.parse_args(argv)
    ctx = zmq.Context()
    out: dict = {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}}
    with broker("host") as sd:
        say("[1/6] rss")
        r = out["rss"] = run_rss(sd, args.replies, ctx)
        print(f"rss      broker {r['idle_mib']:.0f} MiB idle, {r['loaded_mib']:.0f} MiB with 2 sessions x "
              f"{r['replies_each']} unread large replies (x{r['ratio']:.2f})", flush=True)
    with broker("host") as sd:
        say(f"[2/6] quiet ({args.seconds:g} s)")
        quiet = out["quiet"] = honest(sd, args.seconds)
        print(line("quiet", quiet, None), flush=True)
        say("[3/6] 1,000 idle control connections")
        idle = IdleConnections(sd, 1000)
        try:
            out["idle"] = honest(sd, args.seconds)
        finally:
            idle.close()
        print(line("idle", out["idle"], quiet), flush=True)
        say("[4/6] 100 bare ZeroMQ connections")
        bare = BareZmq(sd, 100, ctx)
        try:
            out["bare"] = honest(sd, args.seconds)
        finally:
            bare.close()
        print(line("bare", out["bare"], quiet), flush=True)
        say("[5/6] a session with 4,096 watches that never reads")
        with ipcpool.connect(sd, timeout=30) as watcher:
            subs = [watcher.subscribe("") for _ in range(4096)]
            out["watches"] = honest(sd, args.seconds)
            del subs
        print(line("watches", out["watches"], quiet), flush=True)
    with broker("host") as sd:
        say(f"[6/6] {args.pipeline} pipelined create+seal")
        p = out["pipeline"] = run_pipeline(sd, args.pipeline)
        print(f"pipeline {p['creates']} create+seal settled in {p['seconds']:.2f} s, {p['errors']} errors, "
              f"{p['objects']} objects", flush=True)
    ctx.term()
    if args.json is not None:
        args.json.write_text(__import__("json").dumps(out, indent=2))
        where = args.json
    else:
        where = write_json(f"abuse_host_{time.strftime('%Y%m%d-%H%M%S')}", out)
    say(f"wrote {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
