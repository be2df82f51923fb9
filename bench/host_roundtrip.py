"""Host backend: allocate+free round-trip latency and allocations/s with 1, 4 and 16 clients,
against a raw Python AF_UNIX ping-pong measured in the same run.

    .venv/bin/python bench/host_roundtrip.py [--iterations N]

Writes bench/results/host_roundtrip.json and .png (``--out-dir``: elsewhere; `make bench` writes
bench/out/, which git ignores, so a run never overwrites the results kept in the repository).
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import socket
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import RESULTS, broker, machine, percentiles, save  # noqa: E402
from ipcpool.progress import Progress  # noqa: E402

CTX = mp.get_context("spawn")
WARMUP = 200


def _echo_server(path: str, ready) -> None:
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    srv.bind(path)
    srv.listen(1)
    ready.set()
    conn, _ = srv.accept()
    while data := conn.recv(4096):
        conn.send(data)


def _pingpong(label: str, send, recv, iterations: int) -> list[int]:
    """Round trips of a 64-byte message: send, then wait for the echo."""
    msg = b"x" * 64
    samples = []
    with Progress(label, WARMUP + iterations, stream=sys.stdout) as bar:
        for i in range(WARMUP + iterations):
            t0 = time.perf_counter_ns()
            send(msg)
            recv()
            if i >= WARMUP:
                samples.append(time.perf_counter_ns() - t0)
            bar.update()
    return samples


@contextlib.contextmanager
def _echo(server, address: str):
    """An echo server process on ``address``, started and ready; joined on the way out."""
    ready = CTX.Event()
    proc = CTX.Process(target=server, args=(address, ready), daemon=True)
    proc.start()
    ready.wait(30)
    yield
    proc.join(10)


def raw_pingpong(iterations: int) -> list[int]:
    """Round trips of a 64-byte message over AF_UNIX between two Python processes."""
    with tempfile.TemporaryDirectory() as tmp, _echo(_echo_server, path := f"{tmp}/echo.sock"):
        c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        c.connect(path)
        samples = _pingpong("raw AF_UNIX ping-pong", c.send, lambda: c.recv(4096), iterations)
        c.close()
    return samples


def _zmq_echo_server(endpoint: str, ready) -> None:
    import zmq

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(endpoint)
    ready.set()
    while True:
        frames = router.recv_multipart()
        if frames[1] == b"stop":
            break
        router.send_multipart(frames)
    router.close(0)
    ctx.term()


def raw_zmq_pingpong(iterations: int) -> list[int]:
    """The floor of the message channel: pyzmq DEALER -> ROUTER echo over ipc, no ipcpool."""
    import zmq

    with tempfile.TemporaryDirectory() as tmp, _echo(_zmq_echo_server, endpoint := f"ipc://{tmp}/echo.zmq"):
        ctx = zmq.Context()
        d = ctx.socket(zmq.DEALER)
        d.connect(endpoint)
        samples = _pingpong("raw pyzmq ping-pong", d.send, d.recv, iterations)
        d.send(b"stop")
        d.close(1000)
        ctx.term()
    return samples


def _client(socket_dir: str, iterations: int, start, out) -> None:
    import ipcpool

    with ipcpool.connect(socket_dir) as c:
        for _ in range(WARMUP):
            c.allocate(4096).free()
        start.wait(60)
        samples = []
        t_begin = time.perf_counter_ns()
        for _ in range(iterations):
            t0 = time.perf_counter_ns()
            c.allocate(4096).free()
            samples.append(time.perf_counter_ns() - t0)
        out.put((samples, time.perf_counter_ns() - t_begin))


def ipcpool_clients(socket_dir: Path, clients: int, iterations: int) -> dict:
    start, out = CTX.Event(), CTX.Queue()
    procs = [CTX.Process(target=_client, args=(str(socket_dir), iterations, start, out)) for _ in range(clients)]
    for p in procs:
        p.start()
    time.sleep(0.5 + 0.1 * clients)   # let every client connect and warm up
    t0 = time.perf_counter()
    start.set()
    samples: list[int] = []
    with Progress(f"ipcpool, {clients} client(s)", clients, stream=sys.stdout) as bar:
        for _ in range(clients):
            s, _ = out.get(timeout=600)
            samples += s
            bar.update()
    wall = time.perf_counter() - t0
    for p in procs:
        p.join(30)
    return {"clients": clients, "allocs_per_s": clients * iterations / wall, **percentiles(samples)}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["ipcpool"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    labels = ["raw AF_UNIX", "raw pyzmq"] + [f"{r['clients']} client(s)" for r in rows]
    p50 = [results["raw_af_unix"]["p50_us"], results["raw_zmq"]["p50_us"]] + [r["p50_us"] for r in rows]
    p99 = [results["raw_af_unix"]["p99_us"], results["raw_zmq"]["p99_us"]] + [r["p99_us"] for r in rows]
    x = range(len(labels))
    ax1.bar([i - 0.2 for i in x], p50, 0.4, label="p50")
    ax1.bar([i + 0.2 for i in x], p99, 0.4, label="p99")
    ax1.set_xticks(list(x), labels, rotation=20)
    ax1.set_ylabel("µs per round trip")
    ax1.set_title("allocate+free vs raw ping-pong")
    ax1.legend()
    ax2.plot([r["clients"] for r in rows], [r["allocs_per_s"] for r in rows], marker="o")
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("clients")
    ax2.set_ylabel("allocations / s (all clients)")
    ax2.set_title(f"throughput ({results['machine']['cpus']} CPUs)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=5000, help="round trips per client")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--out-dir", type=Path, default=RESULTS, help="where the JSON and PNG go (default bench/results)")
    args = parser.parse_args()

    results = {"benchmark": "host_roundtrip", "machine": machine(), "iterations": args.iterations}
    results["raw_af_unix"] = percentiles(raw_pingpong(args.iterations))
    results["raw_zmq"] = percentiles(raw_zmq_pingpong(args.iterations))
    with broker("host") as socket_dir:
        results["ipcpool"] = [ipcpool_clients(socket_dir, n, args.iterations) for n in args.clients]
    one = results["ipcpool"][0]
    results["ratio_p50_vs_raw"] = one["p50_us"] / results["raw_af_unix"]["p50_us"]
    results["ratio_p50_vs_zmq"] = one["p50_us"] / results["raw_zmq"]["p50_us"]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = save("host_roundtrip", results, plot, args.out_dir)

    raw = results["raw_af_unix"]
    print(f"\n{'':<24}{'p50 µs':>10}{'p99 µs':>10}{'allocs/s':>12}")
    print(f"{'raw AF_UNIX ping-pong':<24}{raw['p50_us']:>10.1f}{raw['p99_us']:>10.1f}{'':>12}")
    z = results["raw_zmq"]
    print(f"{'raw pyzmq ping-pong':<24}{z['p50_us']:>10.1f}{z['p99_us']:>10.1f}{'':>12}")
    for r in results["ipcpool"]:
        print(f"{'ipcpool x' + str(r['clients']):<24}{r['p50_us']:>10.1f}{r['p99_us']:>10.1f}{r['allocs_per_s']:>12.0f}")
    print(f"p50 ratio, 1 client: {results['ratio_p50_vs_raw']:.2f}x raw AF_UNIX, "
          f"{results['ratio_p50_vs_zmq']:.2f}x raw pyzmq   -> {path}")


if __name__ == "__main__":
    main()
