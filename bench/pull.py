"""A checkpoint pulled from one broker into another through NIXL, beside its floor and beside a
reload from disk.

  pull     `ipcpool pull` as a library call: a new version in the second broker, NIXL READs of
           the first broker's memory (or the buffers staged for it: on CUDA GPU buffers by
           default, IPCPOOL_NIXL_STAGING to choose), a digest per tensor, the publish (transfer
           and whole pull timed apart; the staging copies are in the whole pull)
  floor    NIXL alone moving the same bytes: two agents, two plain buffers (numpy on the host,
           torch on a GPU), one READ of the whole size; nothing of ipcpool between. Into one
           buffer used again, and (a second line) into fresh host memory each time, as a pull's
           new version is
  reload   the same safetensors file read again into the second broker (`load_checkpoint`,
           from the page cache): what a node does today without a peer

The pull's transfer and the floor are timed alike: from transfer() of the xfer, made
beforehand, to check_xfer_state saying DONE, polled without pause (the pull's: with 4 CPUs or
more); each agent's first read, of a few bytes (UCX's set-up for the memory it reads), is off the
clock. Each runs --repeat times; the lines give medians.

Both brokers run on this machine, each with its own socket directory (on CUDA the second one's
pool on --peer-device, a second GPU where there is one). The transport UCX chose (its own
protocol table, as `ipcpool pull` reports it) is part of every NIXL line; GPU memory that went
over TCP is flagged. Writes bench/results/pull_<device>_<date>.json and a PNG beside it.

    python bench/pull.py --backend host --gib 1
    python bench/pull.py --backend cuda --gib 8 --peer-device 1
    UCX_TLS=tcp,self python bench/pull.py --backend host    # the transport held to TCP
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import ipcpool  # noqa: E402
from bench.common import broker, gpu_device, gpu_model, machine, progress, save  # noqa: E402
from bench.weights import write_model  # noqa: E402
from ipcpool.fleet import nixl, transport  # noqa: E402
from ipcpool.fleet.pull import WARM, pull  # noqa: E402

SPAWN = mp.get_context("spawn")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node(name: str, port: int, peer: str, peer_port: int, device: int, backend: str) -> str:
    pool = f'[[pools]]\nname = "default"\nmax_size = "{"0" if backend == "cuda" else "48G"}"\ndevice = {device}\n'
    return (f'[nixl]\nname = "{name}"\nport = {port}\nserve = [""]\n[peers]\n{peer} = "127.0.0.1:{peer_port}"\n'
            + pool)


def serve_peer(socket_dir: Path) -> subprocess.Popen:
    log = socket_dir.parent / "serve-peer.log"
    proc = subprocess.Popen([sys.executable, "-m", "ipcpool", "serve-peer", "--socket-dir", str(socket_dir),
                             "--config", str(socket_dir.parent / "b.toml")], stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while "serving checkpoints" not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"serve-peer did not start:\n{log.read_text(errors='replace')}")
        time.sleep(0.05)
    return proc


# -- the floor: NIXL alone ---------------------------------------------------------------------------
def _buffer(nbytes: int, on_gpu: bool, device: int, touched: bool = True):
    """(keep-alive, address, device) of ``nbytes`` of plain memory; ``touched=False``: host pages
    never written yet, as a new version's are (the first write to each page faults it in)."""
    if on_gpu:
        import torch

        t = torch.ones(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
        return t, t.data_ptr(), device
    import numpy as np

    a = np.ones(nbytes, dtype=np.uint8) if touched else np.empty(nbytes, dtype=np.uint8)
    return a, a.ctypes.data, 0


def _floor_target(nbytes: int, on_gpu: bool, device: int, port: int, out, stop) -> None:
    keep, addr, dev = _buffer(nbytes, on_gpu, device)
    agent = nixl.agent("floor-target", port, on_gpu)
    agent.register_memory([(addr, nbytes, dev, "")], nixl.memory_type(on_gpu))
    out.put((addr, dev))
    stop.wait(600)
    del keep


def _read(agent, local: tuple, remote: tuple, memory: str) -> float:
    """Seconds of one READ of one descriptor, made beforehand: transfer() to DONE."""
    handle = agent.initialize_xfer("READ", agent.get_xfer_descs([local], memory),
                                   agent.get_xfer_descs([remote], memory), "floor-target")
    t0 = time.perf_counter()
    state = agent.transfer(handle)
    while state == "PROC":
        state = agent.check_xfer_state(handle)
    seconds = time.perf_counter() - t0
    agent.release_xfer_handle(handle)
    if state != "DONE":
        raise RuntimeError(f"the floor's READ ended {state}")
    return seconds


def floor(nbytes: int, on_gpu: bool, devices: tuple[int, int], repeat: int) -> dict:
    """Seconds of one READ of ``nbytes`` from another process's registered buffer, ``repeat`` times."""
    port = free_port()
    out, stop = SPAWN.Queue(), SPAWN.Event()
    target = SPAWN.Process(target=_floor_target, args=(nbytes, on_gpu, devices[0], port, out, stop))
    target.start()
    try:
        addr, dev = out.get(timeout=120)
        memory = nixl.memory_type(on_gpu)
        mark = transport.mark()
        with transport.capturing():
            agent = nixl.agent("floor-reader", 0, on_gpu)
        agent.fetch_remote_metadata("floor-target", "127.0.0.1", port)
        while not agent.check_remote_metadata("floor-target"):
            time.sleep(0.001)
        runs: dict[str, list[float]] = {"warm": [], "fresh": []}
        for i in range(2 * repeat):   # into one buffer used again, and into a fresh one each time
            kind = "warm" if i < repeat else "fresh"
            if kind == "fresh" or i == 0:
                keep, mine, my_dev = _buffer(nbytes, on_gpu, devices[1], touched=kind == "warm")
                registered = agent.register_memory([(mine, nbytes, my_dev, "")], memory)
            if i == 0:   # off the clock, as a pull's first read
                _read(agent, (mine, WARM, my_dev), (addr, WARM, dev), memory)
            runs[kind].append(_read(agent, (mine, nbytes, my_dev), (addr, nbytes, dev), memory))
            if kind == "fresh" or i == repeat - 1:
                agent.deregister_memory(registered)
                del keep
        return {**runs, "transport": transport.since(mark).describe()}
    finally:
        stop.set()
        target.join(30)
        if target.is_alive():
            target.kill()


# -- the run -----------------------------------------------------------------------------------------
def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def summary(nbytes: int, runs: list[float]) -> dict:
    best, median = min(runs), statistics.median(runs)
    return {"seconds": runs, "median_s": median, "best_s": best, "median_gbps": gbps(nbytes, median)}


def run(args) -> dict:
    on_gpu = args.backend == "cuda"
    pa, pb = free_port(), free_port()
    data: dict = {"benchmark": "pull", "backend": args.backend, "machine": machine(), "repeat": args.repeat,
                  "ucx_tls": os.environ.get("UCX_TLS", "(UCX's default)")}
    if on_gpu:
        data["gpu"] = gpu_device()
        data["devices"] = [args.device, args.peer_device]
    with tempfile.TemporaryDirectory(prefix="ipcpool-pull-") as tmp, \
            broker(args.backend, node("a", pa, "b", pb, args.device, args.backend)) as sa, \
            broker(args.backend, node("b", pb, "a", pa, args.peer_device, args.backend)) as sb:
        path = Path(tmp) / "model.safetensors"
        progress(f"writing a {args.gib} GiB model in {args.tensors} tensors")
        data["model"] = write_model(path, args.gib, args.tensors)
        nbytes = data["model"]["bytes"]
        with ipcpool.connect(sa) as a:
            a.load_checkpoint("model", path, progress=True)
        server = serve_peer(sa)
        try:
            pulls, totals, transports, stagings = [], [], set(), set()
            with ipcpool.connect(sb) as b:
                for i in range(args.repeat):
                    progress(f"pull {i + 1}/{args.repeat}")
                    r = pull(b, "a", "model", config=sb.parent / "b.toml", progress=True)
                    pulls.append(r.seconds)
                    totals.append(r.total_seconds)
                    transports.add(r.transport.describe())
                    stagings.add(r.staged or "registered as they are")
                    if r.warning:
                        progress(f"warning: {r.warning}")
                    data["pulled_bytes"] = r.nbytes
                    b.delete_checkpoint("model")
                data["pull"] = {**summary(r.nbytes, pulls), "whole_pull": summary(r.nbytes, totals),
                                "transport": " / ".join(sorted(transports)), "tcp_gpu": r.transport.tcp_gpu,
                                "staging": " / ".join(sorted(stagings))}
                reloads = []
                for i in range(args.repeat):
                    progress(f"reload {i + 1}/{args.repeat}")
                    t0 = time.perf_counter()
                    b.load_checkpoint("model", path, progress=True)
                    reloads.append(time.perf_counter() - t0)
                    b.delete_checkpoint("model")
                data["reload"] = summary(nbytes, reloads)
        finally:
            server.terminate()
            server.wait(30)
    progress(f"NIXL floor: {args.repeat} READs of {data['pulled_bytes']} bytes")
    got = floor(data["pulled_bytes"], on_gpu, (args.device, args.peer_device), args.repeat)
    data["floor"] = {**summary(data["pulled_bytes"], got["warm"]), "transport": got["transport"],
                     "fresh_destination": summary(data["pulled_bytes"], got["fresh"])}
    data["pull_over_floor"] = data["pull"]["median_s"] / data["floor"]["median_s"]
    return data


def lines(data: dict) -> list[str]:
    n = data["pulled_bytes"]
    p, f, r = data["pull"], data["floor"], data["reload"]
    return [f"pull (transfer)  {p['median_s']:.3f} s  {p['median_gbps']:.2f} GB/s  over {p['transport']}; "
            f"{p['staging']}",
            f"pull (whole)     {p['whole_pull']['median_s']:.3f} s  {p['whole_pull']['median_gbps']:.2f} GB/s  "
            f"(metadata, manifest, digests, publish)  over {p['transport']}",
            f"NIXL floor       {f['median_s']:.3f} s  {f['median_gbps']:.2f} GB/s  over {f['transport']}",
            f"  into fresh mem {f['fresh_destination']['median_s']:.3f} s  "
            f"{f['fresh_destination']['median_gbps']:.2f} GB/s  over {f['transport']}",
            f"reload from file {r['median_s']:.3f} s  {gbps(n, r['median_s']):.2f} GB/s  (no NIXL)",
            f"pull / floor     {data['pull_over_floor']:.2f}x" + ("   GPU MEMORY WENT OVER TCP" if p["tcp_gpu"] else "")]


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["pull\n(transfer)", "pull\n(whole)", "NIXL floor", "NIXL floor\n(fresh memory)", "reload\nfrom file"]
    values = [data["pull"]["median_gbps"], data["pull"]["whole_pull"]["median_gbps"], data["floor"]["median_gbps"],
              data["floor"]["fresh_destination"]["median_gbps"], data["reload"]["median_gbps"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(names, values, color=["tab:blue", "tab:cyan", "tab:gray", "silver", "tab:orange"])
    for i, v in enumerate(values):
        ax.text(i, v, f"{v:.2f}", ha="center", va="bottom")
    ax.set_ylabel("GB/s (median)")
    ax.set_title(f"{data['model']['bytes'] / (1 << 30):.1f} GiB checkpoint between two brokers ({data['backend']}); "
                 f"pull over {data['pull']['transport']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=["cuda", "host"], default="host")
    ap.add_argument("--gib", type=float, default=1.0, help="the checkpoint's size (default: 1)")
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--device", type=int, default=0, help="CUDA: the first broker's GPU")
    ap.add_argument("--peer-device", type=int, default=0, help="CUDA: the second broker's GPU (a second one if any)")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args(argv)
    if not nixl.available():
        print("bench/pull.py needs NIXL: pip install --no-deps nixl-cu13==1.5.1", file=sys.stderr)
        return 2
    data = run(args)
    for line in lines(data):
        print(line)
    device = "host" if args.backend == "host" else gpu_model(data["gpu"]["device"])
    out = save(f"pull_{device}_{time.strftime('%Y%m%d-%H%M%S')}", data, plot, args.out_dir)
    progress(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
