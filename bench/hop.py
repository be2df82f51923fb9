"""One request's trip to the broker, by channel: the floor under a hand-off's create.

A writer process sends a 128-byte message stamped with its clock to a reader process that spins
(or sleeps in poll) for it; the reader notes the one-way time. Lines: a ZeroMQ DEALER to a ROUTER
(the message channel: two I/O threads between the ends) and an AF_UNIX SEQPACKET pair (the control
socket, where the hand-off's create and seal go as frames: ``ipcpool.frames``). Host only: no GPU
is involved, but run it on the GPU machine to see that machine's costs.

    .venv/bin/python bench/hop.py [--messages 3000]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import struct
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import machine, percentiles, save  # noqa: E402

STAMP = struct.Struct("<q")
PAD = b"x" * 120
GAP_S = 200e-6   # between messages: each one finds the reader idle, as a create does


def _receive(take, n: int, out) -> None:
    times = []
    for _ in range(n):
        data = take()
        times.append(time.perf_counter_ns() - STAMP.unpack_from(data)[0])
    out.put(times)


def _zmq_reader(addr: str, n: int, spin: bool, ready, out) -> None:
    import zmq

    router = zmq.Context().socket(zmq.ROUTER)
    router.bind(addr)
    ready.put(True)
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)

    def take() -> bytes:
        while True:
            if not spin:
                poller.poll(1000)
            try:
                return router.recv_multipart(zmq.NOBLOCK)[1]
            except zmq.Again:
                pass
    _receive(take, n, out)


def _zmq_writer(addr: str, n: int) -> None:
    import zmq

    dealer = zmq.Context().socket(zmq.DEALER)
    dealer.connect(addr)
    time.sleep(0.3)   # connected before the first stamp
    for _ in range(n):
        dealer.send(STAMP.pack(time.perf_counter_ns()) + PAD)
        time.sleep(GAP_S)
    time.sleep(0.2)


def _unix_reader(sock: socket.socket, n: int, spin: bool, out) -> None:
    sock.setblocking(not spin)

    def take() -> bytes:
        while True:
            try:
                return sock.recv(512)
            except BlockingIOError:
                pass
    _receive(take, n, out)


def _unix_writer(sock: socket.socket, n: int) -> None:
    time.sleep(0.3)
    for _ in range(n):
        sock.send(STAMP.pack(time.perf_counter_ns()) + PAD)
        time.sleep(GAP_S)


def run(kind: str, spin: bool, n: int) -> dict:
    ctx = mp.get_context("fork")
    out, ready = ctx.SimpleQueue(), ctx.SimpleQueue()
    if kind == "zmq":
        addr = f"ipc://{tempfile.gettempdir()}/ipcpool-hop-{os.getpid()}.zmq"
        reader = ctx.Process(target=_zmq_reader, args=(addr, n, spin, ready, out))
        reader.start()
        ready.get()
        writer = ctx.Process(target=_zmq_writer, args=(addr, n))
    else:
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        reader = ctx.Process(target=_unix_reader, args=(b, n, spin, out))
        reader.start()
        writer = ctx.Process(target=_unix_writer, args=(a, n))
    writer.start()
    times = out.get()
    for p in (writer, reader):
        p.join(30)
    return percentiles(times[n // 10:])


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["lines"])
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.barh(names, [result["lines"][k]["p50_us"] for k in names])
    ax.set_xlabel("one-way µs, p50")
    ax.set_title("a 128-byte message to the broker, by channel")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=3000)
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args()
    lines = {}
    for kind, label in (("zmq", "ZeroMQ DEALER -> ROUTER"), ("unix", "AF_UNIX SEQPACKET")):
        for spin in (True, False):
            name = f"{label}, reader {'spinning' if spin else 'in poll'}"
            lines[name] = run(kind, spin, args.messages)
            print(f"{name:<44} p50 {lines[name]['p50_us']:7.1f} µs  p99 {lines[name]['p99_us']:7.1f} µs", flush=True)
    result = {"benchmark": "hop", "machine": machine(), "messages": args.messages, "lines": lines}
    kwargs = {"out_dir": args.out_dir} if args.out_dir else {}
    print("->", save(f"hop_{os.cpu_count()}cpu_{time.strftime('%Y%m%d')}", result, plot, **kwargs))


if __name__ == "__main__":
    main()
