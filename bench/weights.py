"""Model weights through ipcpool checkpoints, each step beside its peers in one run.

  cold load   ipcpool load_checkpoint  vs  safetensors load_file(device=...)  vs  a hand-written
              pinned double-buffered read (CUDA; on the host: readinto one buffer)
  attach      N fresh worker processes attach  vs  torch.multiprocessing (state dict through a
              queue)  vs  an attach floor (CUDA: one IPC handle of one flat buffer, views built,
              nothing of ipcpool between)
  swap        a trainer publishes a new version from live tensors, N readers move to it (from the
              trainer's first call to every reader on the new tensors)  vs  per-tensor CUDA IPC
              (reduce_tensor / rebuild_cuda_tensor, what RL frameworks use); beside the
              device-to-device copy of its bytes (the figure the goal is stated in)

Cases: "small" (64 tensors, 64 MiB) and "model" (--model-gib in --model-tensors). The file is
synthetic safetensors written here (read from the page cache: "cold" means not in ipcpool yet).
Writes bench/results/weights_<device>_<date>.json and a PNG beside it. ``--backend host`` runs
on a machine without a GPU (the CUDA peers are skipped).

    python bench/weights.py                          # CUDA: small + 8 GiB in 320 tensors, 4 readers
    python bench/weights.py --backend host --model-gib 1
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

import ipcpool  # noqa: E402

SPAWN = mp.get_context("spawn")
STEP = [0, 0]


def step(text: str) -> None:
    STEP[0] += 1
    print(f"[{STEP[0]}/{STEP[1]}] {text}", file=sys.stderr, flush=True)


# -- the synthetic model --------------------------------------------------------------------------
def write_model(path: Path, gib: float, count: int) -> dict:
    """``count`` bf16-sized (2-byte) tensors of about ``gib`` GiB in all, as safetensors."""
    per = int(gib * (1 << 30)) // count // 2 // 256 * 256
    header, at = {}, 0
    for i in range(count):
        header[f"layers.{i}.weight"] = {"dtype": "F16", "shape": [per // 256, 256], "data_offsets": [at, at + per * 2]}
        at += per * 2
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        block = np.arange(per, dtype=np.float16).tobytes()
        for i in range(count):
            f.write(block)
    return {"bytes": at, "tensors": count}


# -- a private broker -------------------------------------------------------------------------------
def start_broker(sock: Path, backend: str, log: Path) -> subprocess.Popen:
    cfg = sock.parent / "broker.toml"
    cfg.write_text('[[pools]]\nname = "default"\nmax_size = "0"\n' if backend == "cuda" else
                   '[[pools]]\nname = "default"\nmax_size = "48G"\n')
    p = subprocess.Popen([sys.executable, "-m", "ipcpool", "broker", "--socket-dir", str(sock), "--backend", backend,
                          "--config", str(cfg)], stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with ipcpool.connect(sock, timeout=5) as c:
                c.stats()
            return p
        except ipcpool.BrokerGone:
            if p.poll() is not None:
                raise RuntimeError(log.read_text())
            time.sleep(0.05)
    raise RuntimeError("broker not ready")


# -- cold load ------------------------------------------------------------------------------------
def load_ipcpool(sock: Path, path: Path, name: str) -> float:
    with ipcpool.connect(sock) as c:
        t0 = time.perf_counter()
        c.load_checkpoint(name, path, progress=False)
        if c.backend == "cuda":
            import torch

            torch.cuda.synchronize()
        took = time.perf_counter() - t0
        c.delete_checkpoint(name)
    return took


def load_safetensors(path: Path, device: str) -> float:
    from safetensors.torch import load_file

    t0 = time.perf_counter()
    out = load_file(str(path), device=device)
    if device == "cuda":
        import torch

        torch.cuda.synchronize()
    took = time.perf_counter() - t0
    del out
    return took


def load_floor(path: Path, nbytes: int, device: str, slot: int = 16 << 20, slots: int = 4) -> float:
    """Pinned, double-buffered (CUDA): read the next slot while the last one copies. Host: read
    the whole data into one buffer. Nothing but the reads and copies."""
    fd = os.open(path, os.O_RDONLY)
    try:
        head = int.from_bytes(os.pread(fd, 8, 0), "little") + 8
        if device != "cuda":
            buf = np.empty(nbytes, dtype=np.uint8)
            t0 = time.perf_counter()
            mv, done = memoryview(buf), 0
            while done < nbytes:
                done += os.preadv(fd, [mv[done : done + (64 << 20)]], head + done)
            return time.perf_counter() - t0
        import torch

        dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        pins = [torch.empty(slot, dtype=torch.uint8, pin_memory=True) for _ in range(slots)]
        events = [torch.cuda.Event() for _ in range(slots)]
        stream = torch.cuda.Stream()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for k, at in enumerate(range(0, nbytes, slot)):
            n = min(slot, nbytes - at)
            i = k % slots
            events[i].synchronize()
            os.preadv(fd, [memoryview(pins[i].numpy())[:n]], head + at)
            with torch.cuda.stream(stream):
                dst[at : at + n].copy_(pins[i][:n], non_blocking=True)
                events[i].record(stream)
        stream.synchronize()
        return time.perf_counter() - t0
    finally:
        os.close(fd)


# -- attach -----------------------------------------------------------------------------------------
def _attach_worker(sock, name, kind, q):
    if kind == "torch":
        import torch  # noqa: F401  (its import is not the attach's)
    t0 = time.perf_counter()
    with ipcpool.connect(sock) as c:
        t1 = time.perf_counter()
        with c.attach(name, kind=kind) as ck:
            n = len(ck.tensors)
            t2 = time.perf_counter()
    q.put({"connect_s": t1 - t0, "attach_s": t2 - t1, "tensors": n})


def attach_ipcpool(sock: Path, name: str, kind: str, readers: int) -> list[dict]:
    q = SPAWN.Queue()
    procs = [SPAWN.Process(target=_attach_worker, args=(str(sock), name, kind, q)) for _ in range(readers)]
    for p in procs:
        p.start()
    out = [q.get(timeout=300) for _ in procs]
    for p in procs:
        p.join()
    return out


def _mp_worker(q_in, q_out):
    import torch  # noqa: F401

    if torch.cuda.is_available():
        torch.cuda.init()   # its context made before the clock starts, as an ipcpool worker's is at connect
    q_in.get(timeout=300)   # a warm-up item: the worker is up and torch imported
    t0 = time.perf_counter()
    sd = q_in.get()
    n = len(sd)
    q_out.put({"attach_s": time.perf_counter() - t0, "tensors": n})
    q_in.get()   # hold until the parent is done


def attach_torch_mp(state: dict, readers: int) -> list[dict]:
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    qs = [ctx.Queue() for _ in range(readers)]
    q_out = ctx.Queue()
    procs = [ctx.Process(target=_mp_worker, args=(qi, q_out)) for qi in qs]
    # (a warm-up item first; then the workers are up: time the hand-over, not the start)
    return _hand_over(procs, qs, q_out, state, settle_s=2.0, first=(None,))


def _hand_over(procs: list, qs: list, q_out, payload, settle_s: float, first: tuple = ()) -> list[dict]:
    """Start the workers, give each ``first`` then, ``settle_s`` later, ``payload``; collect one
    result from each, then release and join them."""
    for p in procs:
        p.start()
    for qi in qs:
        for item in first:
            qi.put(item)
    time.sleep(settle_s)
    for qi in qs:
        qi.put(payload)
    out = [q_out.get(timeout=300) for _ in procs]
    for qi in qs:
        qi.put(None)
    for p in procs:
        p.join()
    return out


def _floor_worker(handle_q, layout, q_out):
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    torch.cuda.init()
    args = handle_q.get()
    t0 = time.perf_counter()
    flat = rebuild_cuda_tensor(*args)
    views = {k: flat[off : off + n].view(torch.float16) for k, off, n in layout}
    q_out.put({"attach_s": time.perf_counter() - t0, "tensors": len(views)})
    handle_q.get()


def attach_floor(state: dict, readers: int) -> list[dict]:
    """One flat buffer, one IPC handle, views at offsets: what an attach needs at least."""
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    total = sum(t.numel() * t.element_size() for t in state.values())
    flat = torch.empty(total, dtype=torch.uint8, device="cuda")
    layout, at = [], 0
    for k, t in state.items():
        n = t.numel() * t.element_size()
        flat[at : at + n].copy_(t.view(-1).view(torch.uint8))
        layout.append((k, at, n))
        at += n
    torch.cuda.synchronize()
    _, args = reduce_tensor(flat)
    qs = [SPAWN.Queue() for _ in range(readers)]
    q_out = SPAWN.Queue()
    procs = [SPAWN.Process(target=_floor_worker, args=(qi, layout, q_out)) for qi in qs]
    return _hand_over(procs, qs, q_out, args, settle_s=3.0)   # CUDA initialised in each: time the import only


# -- swap -------------------------------------------------------------------------------------------
def _swap_reader(sock, name, kind, poll_s, q_ready, q_out):
    with ipcpool.connect(sock) as c, c.attach(name, kind=kind) as ck:
        first = ck.version
        q_ready.put(first)
        while not ck.refresh():
            if poll_s:
                time.sleep(poll_s)   # (a host of few cores: spinning readers would starve the writer)
        q_out.put({"moved_at": time.monotonic(), "version": ck.version, "from": first})


def c_backend(sock: Path) -> str:
    with ipcpool.connect(sock) as c:
        return c.backend


def swap_ipcpool(sock: Path, name: str, state: dict, readers: int, kind: str) -> dict:
    q_ready, q_out = SPAWN.Queue(), SPAWN.Queue()
    # A host of few cores: readers polling without pause (and the broker's busy poll after each
    # request) would take the cores the trainer needs.
    poll_s = 0.0 if c_backend(sock) == "cuda" else 0.005
    procs = [SPAWN.Process(target=_swap_reader, args=(str(sock), name, kind, poll_s, q_ready, q_out))
             for _ in range(readers)]
    for p in procs:
        p.start()
    for _ in procs:
        q_ready.get(timeout=300)
    with ipcpool.connect(sock) as c:
        c.reset_high()
        before = c.stats()["pools"]["default"]["used"]
        t0 = time.monotonic()
        if kind == "torch":
            c.publish_tensors(name, state)
        else:
            with c.new_version(name, [(k, str(v.dtype), v.shape) for k, v in state.items()]) as w:
                for k, t in w.tensors(kind).items():
                    t[...] = state[k]
                w.publish()
        published = time.monotonic()
        moved = [q_out.get(timeout=300) for _ in procs]
        peak = c.stats()["pools"]["default"]["used_high"]
    for p in procs:
        p.join()
    return {"swap_s": max(m["moved_at"] for m in moved) - t0, "publish_s": published - t0,
            "used_before": before, "used_high": peak}


def _ipc_reader(q_in, q_out):
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    torch.cuda.init()
    q_out.put("ready")
    handles = q_in.get()
    tensors = {k: rebuild_cuda_tensor(*a) for k, a in handles}
    q_out.put({"done_at": time.monotonic(), "tensors": len(tensors)})
    q_in.get()


def swap_per_tensor_ipc(state: dict, readers: int) -> dict:
    """What RL frameworks do: a handle per tensor, rebuilt one by one in each reader."""
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    qs = [SPAWN.Queue() for _ in range(readers)]
    q_out = SPAWN.Queue()
    procs = [SPAWN.Process(target=_ipc_reader, args=(qi, q_out)) for qi in qs]
    for p in procs:
        p.start()
    for _ in procs:
        q_out.get(timeout=300)
    t0 = time.monotonic()
    new = {k: v.clone() for k, v in state.items()}   # the new version's bytes, as the trainer makes them
    torch.cuda.synchronize()
    handles = [(k, reduce_tensor(t)[1]) for k, t in new.items()]
    for qi in qs:
        qi.put(handles)
    done = [q_out.get(timeout=300) for _ in procs]
    took = max(d["done_at"] for d in done) - t0
    for qi in qs:
        qi.put(None)
    for p in procs:
        p.join()
    return {"swap_s": took}


def d2d_copy(state: dict) -> float:
    import torch

    dst = {k: torch.empty_like(v) for k, v in state.items()}
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for k, v in state.items():
        dst[k].copy_(v, non_blocking=True)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


# -- the run -----------------------------------------------------------------------------------------
def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def run_case(label: str, path: Path, info: dict, sock: Path, backend: str, readers: int, repeat: int) -> dict:
    cuda = backend == "cuda"
    try:
        import torch
    except ImportError:
        torch = None
    kind = "torch" if torch is not None else "numpy"
    res: dict = {"case": label, **info}
    step(f"{label}: cold load x{repeat}")
    res["load_ipcpool_s"] = median([load_ipcpool(sock, path, f"bench-{label}-load") for _ in range(repeat)])
    if torch is not None:
        step(f"{label}: safetensors load_file x{repeat}")
        res["load_safetensors_s"] = median([load_safetensors(path, "cuda" if cuda else "cpu") for _ in range(repeat)])
    step(f"{label}: pinned floor x{repeat}")
    res["load_floor_s"] = median([load_floor(path, info["bytes"], backend) for _ in range(repeat)])
    name = f"bench-{label}"
    with ipcpool.connect(sock) as c:
        c.load_checkpoint(name, path, progress=False)
        step(f"{label}: attach by {readers} workers")
        got = attach_ipcpool(sock, name, kind, readers)
        res["attach_ipcpool_s"] = max(g["attach_s"] for g in got)
        res["attach_ipcpool_each_s"] = [g["attach_s"] for g in got]
        if torch is not None:
            with c.attach(name, kind="torch") as ck:
                state = {k: (v.clone() if cuda else v.clone()) for k, v in ck.tensors.items()}
            step(f"{label}: torch.multiprocessing attach")
            res["attach_torch_mp_s"] = max(g["attach_s"] for g in attach_torch_mp(state, readers))
            if cuda:
                step(f"{label}: attach floor (one IPC handle)")
                res["attach_floor_s"] = max(g["attach_s"] for g in attach_floor(state, readers))
                res["d2d_copy_s"] = median([d2d_copy(state) for _ in range(repeat)])
            step(f"{label}: swap to {readers} readers")
            res.update({f"swap_ipcpool_{k}": v for k, v in swap_ipcpool(sock, name, state, readers, "torch").items()})
            if cuda:
                step(f"{label}: swap by per-tensor CUDA IPC")
                res["swap_per_tensor_ipc_s"] = swap_per_tensor_ipc(state, readers)["swap_s"]
                res["swap_goal_s"] = 2 * res["d2d_copy_s"] + 0.010
            del state
        else:
            with c.attach(name, kind="numpy") as ck:
                state = {k: v.copy() for k, v in ck.tensors.items()}
            step(f"{label}: swap to {readers} readers")
            res.update({f"swap_ipcpool_{k}": v for k, v in swap_ipcpool(sock, name, state, readers, "numpy").items()})
        c.delete_checkpoint(name)
    return res


LABELS = {"load_ipcpool_s": "ipcpool", "load_safetensors_s": "safetensors", "load_floor_s": "pinned floor",
          "attach_ipcpool_s": "ipcpool", "attach_torch_mp_s": "torch.mp", "attach_floor_s": "IPC floor",
          "swap_ipcpool_swap_s": "ipcpool", "swap_per_tensor_ipc_s": "per-tensor IPC", "swap_goal_s": "goal: 2x d2d+10ms"}


def plot(results: list[dict], png: Path, device: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = {"load": ["load_ipcpool_s", "load_safetensors_s", "load_floor_s"],
              "attach": ["attach_ipcpool_s", "attach_torch_mp_s", "attach_floor_s"],
              "swap": ["swap_ipcpool_swap_s", "swap_per_tensor_ipc_s", "swap_goal_s"]}
    fig, axes = plt.subplots(len(results), 3, figsize=(13, 3.2 * len(results)), squeeze=False)
    for row, r in zip(axes, results):
        for ax, (g, keys) in zip(row, groups.items()):
            keys = [k for k in keys if k in r]
            ax.bar([LABELS[k] for k in keys],
                   [r[k] * 1e3 for k in keys], color=["tab:blue", "tab:orange", "tab:gray"][: len(keys)])
            ax.set_title(f"{r['case']}: {g} (ms)")
            ax.tick_params(axis="x", labelsize=7)
    fig.suptitle(f"ipcpool checkpoints on {device}")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def device_info(backend: str) -> dict:
    if backend != "cuda":
        return {"device": "host", "name": platform.processor() or platform.machine(), "driver": None}
    import torch

    name = torch.cuda.get_device_name(0)
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.TimeoutExpired):
        driver = None
    short = "h200" if "H200" in name else "h100" if "H100" in name else name.split()[-1].lower()
    return {"device": short, "name": name, "driver": driver}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=["auto", "cuda", "host"], default="auto")
    ap.add_argument("--cases", default="small,model", help="small, model, or both (default)")
    ap.add_argument("--model-gib", type=float, default=None, help="the model case's size (default: 8 on CUDA, 1 on the host)")
    ap.add_argument("--model-tensors", type=int, default=320)
    ap.add_argument("--readers", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args(argv)
    backend = args.backend
    if backend == "auto":
        from ipcpool.backend import probe_cuda

        backend = "cuda" if probe_cuda()[0] else "host"
    gib = args.model_gib if args.model_gib is not None else (8.0 if backend == "cuda" else 1.0)
    cases = {"small": (1 / 16, 64), "model": (gib, args.model_tensors)}
    chosen = [c for c in args.cases.split(",") if c in cases]
    try:
        import torch  # noqa: F401

        has_torch = 1
    except ImportError:
        has_torch = 0
    STEP[1] = len(chosen) * (5 + 2 * has_torch + (2 if backend == "cuda" else 0))
    results = []
    with tempfile.TemporaryDirectory(prefix="ipcpool-weights-") as tmp:
        tmp = Path(tmp)
        broker = start_broker(tmp / "sock", backend, tmp / "broker.log")
        try:
            for label in chosen:
                path = tmp / f"{label}.safetensors"
                step(f"{label}: writing {cases[label][0]:g} GiB in {cases[label][1]} tensors")
                info = write_model(path, *cases[label])
                results.append(run_case(label, path, info, tmp / "sock", backend, args.readers, args.repeat))
                path.unlink()
                print(json.dumps(results[-1], indent=1), flush=True)
        finally:
            broker.terminate()
            broker.wait(30)
    dev = device_info(backend)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"weights_{dev['device']}_{stamp}.json"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    out.write_text(json.dumps({"date": stamp, **dev, "backend": backend, "commit": commit, "readers": args.readers,
                               "repeat": args.repeat, "results": results}, indent=1))
    plot(results, out.with_suffix(".png"), dev["name"])
    print(f"wrote {out} and {out.with_suffix('.png').name}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
