"""Model weights through ipcpool checkpoints, each step beside its peers in one run.

  cold load   ipcpool load_checkpoint  vs  safetensors load_file(device=...)  vs  the floor: the
              file read into pinned host slots by reader threads, each slot copied to one device
              allocation as it fills (ipcpool's ring, raw driver calls, memory made before the
              clock; on the host: read into one buffer)
  attach      N worker processes, ready (CUDA context made) and released at once, from "go" to
              the last holding views of every tensor: ipcpool attach  vs  torch.multiprocessing
              (state dict through a queue)  vs  the floor (CUDA: the same bytes as VMM chunks whose
              FDs each worker holds before go; import, map, views; nothing of ipcpool)
  swap        a trainer publishes a new version from live tensors, N readers move to it (from the
              trainer's first call to every reader on the new tensors), --rounds in a row: the
              first into fresh memory, the rest into the spare (the steady state, reported)  vs
              per-tensor CUDA IPC (reduce_tensor / rebuild_cuda_tensor, what RL frameworks use);
              the floor: one device-to-device copy of its bytes (the figure the goal is stated in).
              Each round also says where the writer's time went (``WriterPhases``: begin, imports,
              views, the copy's launch and its GPU time, publish, the collector) and how long each
              reader's moving refresh took.

Cases: "small" (64 tensors, 64 MiB) and "model" (--model-gib in --model-tensors). The file is
synthetic safetensors written here (read from the page cache: "cold" means not in ipcpool yet).
Writes bench/results/weights_<device>_<date>.json (machine, device, driver, date) and a PNG beside it. ``--backend host`` runs
on a machine without a GPU (the CUDA peers are skipped).

    python bench/weights.py                          # CUDA: small + 8 GiB in 320 tensors, 4 readers
    python bench/weights.py --backend host --model-gib 1
"""

from __future__ import annotations

import argparse
import contextlib
import json
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

import numpy as np  # noqa: E402

import ipcpool  # noqa: E402
from ipcpool import trace  # noqa: E402
from bench.common import RESULTS, broker, gpu_device, gpu_model, machine, progress, save  # noqa: E402
from ipcpool.backend.filecopy import read_exact  # noqa: E402  (a preadv loop, as any reader has)

SPAWN = mp.get_context("spawn")
STEP = [0, 0]


def step(text: str) -> None:
    STEP[0] += 1
    progress(f"[{STEP[0]}/{STEP[1]}] {text}")


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


def _ok(result):
    """A cuda.bindings call's value, or a RuntimeError naming its error."""
    err, *rest = result
    if int(err) != 0:
        raise RuntimeError(f"CUDA error {err}")
    return rest[0] if len(rest) == 1 else (rest or None)


def load_floor(path: Path, nbytes: int, device: str) -> float:
    """The least a load does, nothing else: on CUDA the file's data read into pinned host slots
    by reader threads, each slot copied (cuMemcpyHtoDAsync) to one device allocation as soon as it
    is full and refilled once its copy is done, ipcpool's ring (slots, their size, readers) with
    the device memory and the pinned slots made before the clock. Host: read into one buffer,
    its pages made before the clock."""
    fd = os.open(path, os.O_RDONLY)
    try:
        head = int.from_bytes(os.pread(fd, 8, 0), "little") + 8
        if device != "cuda":
            buf = np.zeros(nbytes, dtype=np.uint8)
            buf.fill(1)   # its pages made before the clock, as the pool's are
            t0 = time.perf_counter()
            for at in range(0, nbytes, 64 << 20):
                read_exact(fd, memoryview(buf)[at : at + (64 << 20)], head + at)
            return time.perf_counter() - t0
        return _pinned_ring(fd, head, nbytes)
    finally:
        os.close(fd)


def _pinned_ring(fd: int, head: int, nbytes: int) -> float:
    import ctypes
    from concurrent.futures import ThreadPoolExecutor

    from cuda.bindings import driver as cu
    from cuda.core import Device

    from ipcpool.backend.cuda.staging import READERS, SLOT_BYTES, SLOTS   # (the parameters only)

    Device(0).set_current()
    ctx = _ok(cu.cuCtxGetCurrent())
    dst = _ok(cu.cuMemAlloc(nbytes))
    pins = [int(_ok(cu.cuMemHostAlloc(SLOT_BYTES, 0))) for _ in range(SLOTS)]
    views = [memoryview((ctypes.c_ubyte * SLOT_BYTES).from_address(p)).cast("B") for p in pins]
    events = [_ok(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)) for _ in range(SLOTS)]
    stream = _ok(cu.cuStreamCreate(int(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)))
    used = [False] * SLOTS
    pieces = [(at, min(SLOT_BYTES, nbytes - at)) for at in range(0, nbytes, SLOT_BYTES)]

    def fill(i: int) -> None:
        slot, (at, n) = i % SLOTS, pieces[i]
        if used[slot]:
            _ok(cu.cuEventSynchronize(events[slot]))   # its last copy is done
        read_exact(fd, views[slot][:n], head + at)

    readers = ThreadPoolExecutor(READERS, initializer=lambda: _ok(cu.cuCtxSetCurrent(ctx)))
    try:
        t0 = time.perf_counter()
        futures = {i: readers.submit(fill, i) for i in range(min(SLOTS, len(pieces)))}
        for i, (at, n) in enumerate(pieces):
            futures.pop(i).result()
            slot = i % SLOTS
            _ok(cu.cuMemcpyHtoDAsync(int(dst) + at, pins[slot], n, stream))
            _ok(cu.cuEventRecord(events[slot], stream))
            used[slot] = True
            if i + SLOTS < len(pieces):
                futures[i + SLOTS] = readers.submit(fill, i + SLOTS)
        _ok(cu.cuStreamSynchronize(stream))
        return time.perf_counter() - t0
    finally:
        readers.shutdown(wait=True)
        _ok(cu.cuStreamSynchronize(stream))
        for v in views:
            v.release()
        for e, p in zip(events, pins):
            cu.cuEventDestroy(e)
            cu.cuMemFreeHost(p)
        cu.cuStreamDestroy(stream)
        cu.cuMemFree(dst)


# -- attach -----------------------------------------------------------------------------------------
# Every attach is timed alike: N worker processes start, make their CUDA context (and import what
# they use), say "ready"; once all have (a barrier, no sleep), the parent notes the time and says
# "go"; the figure is from "go" to the last worker holding views of every tensor.
def _worker_main(kind: str, arg: str) -> int:
    """A worker process (``--worker KIND ARG``): ready, go, its views, the time it had them."""
    spec = json.loads(arg)
    if spec.get("kind", "torch") == "torch":
        import torch

        if torch.cuda.is_available():
            torch.empty(1, device="cuda")   # its context, before the barrier
    held = []
    if kind == "ipcpool":
        c = ipcpool.connect(spec["sock"])
        ready = lambda: held.append(c.attach(spec["name"], kind=spec["kind"])) or held[-1].tensors   # noqa: E731
    else:
        ready = lambda: _floor_views(torch, spec)   # noqa: E731
    print("ready", flush=True)
    sys.stdin.readline()
    views = ready()
    print(json.dumps({"done_at": time.monotonic(), "tensors": len(views)}), flush=True)
    sys.stdin.readline()   # hold the views until the parent is done
    return 0


def _floor_views(torch, spec: dict) -> dict:
    """The floor's whole attach: the chunk FDs (inherited) imported and mapped into one range,
    access granted, and a view per tensor; nothing of ipcpool."""
    from cuda.bindings import driver as cu

    posix = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    total = sum(spec["sizes"])
    base = int(_ok(cu.cuMemAddressReserve(total, 0, 0, 0)))
    at = base
    for fd, size in zip(spec["fds"], spec["sizes"]):
        handle = _ok(cu.cuMemImportFromShareableHandle(fd, posix))
        _ok(cu.cuMemMap(at, size, 0, handle, 0))
        at += size
    access = cu.CUmemAccessDesc()
    access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    access.location.id = 0
    access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    _ok(cu.cuMemSetAccess(base, total, [access], 1))
    flat = torch.as_tensor(_Cai(base, total), device="cuda").view(torch.float16)
    return {k: flat[off // 2 : off // 2 + n // 2].view(shape) for k, off, n, shape in spec["layout"]}


class _Cai:
    """Device memory as ``__cuda_array_interface__`` (a flat uint8 array), for torch.as_tensor."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}


def _go(kind: str, arg: dict, readers: int, fds: list[int] = ()) -> list[dict]:
    """Start ``readers`` workers, wait until all are ready, say go; each one's result with its
    ``attach_s`` (from go)."""
    cmd = [sys.executable, __file__, "--worker", kind, json.dumps(arg)]
    procs = [subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, pass_fds=list(fds))
             for _ in range(readers)]
    try:
        for p in procs:
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError(f"{kind} worker failed before it was ready (exit {p.wait()})")
        go = time.monotonic()
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        out = [json.loads(p.stdout.readline()) for p in procs]
        for p in procs:
            p.stdin.write("bye\n")
            p.stdin.flush()
    finally:
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
    return [{**o, "attach_s": o["done_at"] - go} for o in out]


def attach_ipcpool(sock: Path, name: str, kind: str, readers: int) -> list[dict]:
    return _go("ipcpool", {"sock": str(sock), "name": name, "kind": kind}, readers)


def _mp_worker(q_in, q_out):
    import torch

    if torch.cuda.is_available():
        torch.empty(1, device="cuda")   # its context, before the barrier
    q_out.put("ready")
    sd = q_in.get()
    q_out.put({"done_at": time.monotonic(), "tensors": len(sd)})
    q_in.get()   # hold until the parent is done


def attach_torch_mp(state: dict, readers: int) -> list[dict]:
    """The state dict through a torch.multiprocessing queue: from go (the parent's put) to the
    last worker holding it."""
    import torch.multiprocessing as tmp

    with _workers(tmp.get_context("spawn"), _mp_worker, readers) as (qs, q_out, ready):
        assert ready == ["ready"] * readers
        go = time.monotonic()
        for qi in qs:
            qi.put(state)
        out = [q_out.get(timeout=300) for _ in qs]
    return [{**o, "attach_s": o["done_at"] - go} for o in out]


@contextlib.contextmanager
def _workers(ctx, target, readers: int):
    """``readers`` spawned workers, each with a queue of its own and one shared answer queue,
    yielded once each has said it is ready (what each said); told to stop (None) and joined after."""
    qs = [ctx.Queue() for _ in range(readers)]
    q_out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(qi, q_out)) for qi in qs]
    for p in procs:
        p.start()
    ready = [q_out.get(timeout=300) for _ in procs]
    try:
        yield qs, q_out, ready
    finally:
        for qi in qs:
            qi.put(None)
        for p in procs:
            p.join()


def attach_floor(state: dict, readers: int) -> list[dict]:
    """The same bytes as VMM chunks of ipcpool's size (what ipcpool hands out above 4 GiB), each
    worker holding their FDs before go: at go, import, map, grant access, build the views."""
    from cuda.bindings import driver as cu

    from ipcpool.backend.cuda.limits import VMM_CHUNK   # (the size only)

    layout, at = [], 0
    for k, t in state.items():
        n = t.numel() * t.element_size()
        layout.append((k, at, n, list(t.shape)))   # (float16, as write_model writes them)
        at += -(-n // 256) * 256
    posix = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = 0
    prop.requestedHandleTypes = posix
    gran = int(_ok(cu.cuMemGetAllocationGranularity(prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)))
    total = -(-at // gran) * gran
    sizes = [min(VMM_CHUNK, total - o) for o in range(0, total, VMM_CHUNK)]
    chunks = [_ok(cu.cuMemCreate(n, prop, 0)) for n in sizes]
    fds = [int(_ok(cu.cuMemExportToShareableHandle(h, posix, 0))) for h in chunks]
    try:
        return _go("floor", {"fds": fds, "sizes": sizes, "layout": layout}, readers, fds)
    finally:
        for h, fd in zip(chunks, fds):
            os.close(fd)
            cu.cuMemRelease(h)


# -- swap -------------------------------------------------------------------------------------------
def _swap_reader(sock, name, kind, rounds, poll_s, q_ready, q_out):
    with ipcpool.connect(sock) as c, c.attach(name, kind=kind) as ck:
        q_ready.put(ck.version)
        for _ in range(rounds):
            before, polls = ck.version, 0
            while True:
                t = time.monotonic()
                polls += 1
                if ck.refresh():
                    break
                if poll_s:
                    time.sleep(poll_s)   # (a host of few cores: spinning readers would starve the writer)
            moved = time.monotonic()
            # refresh_s: the refresh that moved (attach, map, views; the old version's release,
            # which waits on this reader's stream, ordered after the new version's seal). polls:
            # refreshes this round (each a round trip to the broker the writer's requests queue with).
            q_out.put({"moved_at": moved, "refresh_s": moved - t, "polls": polls, "version": ck.version,
                       "from": before})


class WriterPhases:
    """Where the writer's part of each swap goes, from ``ipcpool.trace``'s ``client.phase`` events
    (a perf_counter call at each step's start and end), every pass of the cyclic collector timed
    (``gc.callbacks``), and on CUDA the copy timed on the GPU by two events around it. ``begin_s``
    holds ``import_s`` (the chunk FDs fetched, imported, mapped, access granted: a shard not kept
    from before) and ``let_go_s``; ``publish_call_s`` holds ``release_s`` (a shard not kept: on
    CUDA a VMM mapping's host wait for the copy, then its unmap), ``keep_s`` (a kept shard's done
    event) and the ckpt_publish round trip; ``copy_call_s`` is the host's time to launch the copy,
    ``copy_gpu_s`` the copy on the GPU. ``call_<op>_s``: the writer's requests that wait for their
    answer, by op (``control_s``: on the control socket, the chunk FDs), each a round trip with
    the broker's handling."""

    KEYS = {"begin": "begin_s", "import": "import_s", "let_go": "let_go_s", "views": "views_s",
            "copy": "copy_call_s", "publish": "publish_call_s", "release": "release_s", "keep": "keep_s",
            "control": "control_s"}

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self._open: dict[str, list] = {}   # key -> its starts not ended yet (a step may nest)
        self._events: list = []
        self._gc_t0 = 0.0
        self._tracing = None

    def __enter__(self) -> WriterPhases:
        import gc

        self._tracing = trace.tracing(self._on_event)
        self._tracing.__enter__()
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc) -> None:
        import gc

        self._tracing.__exit__(*exc)
        gc.callbacks.remove(self._on_gc)

    def _on_event(self, event: str, info: dict) -> None:
        if event != "client.phase":
            return
        phase = info["phase"]
        key = f"call_{info['args'][1]}_s" if phase == "call" else self.KEYS.get(phase)
        if key is None:
            return
        if info["at"] == "start":
            events = None
            if phase == "copy" and self.cuda:   # (on the copy's stream: publish_tensors made it current)
                import torch

                events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                events[0].record()
            self._open.setdefault(key, []).append((time.perf_counter(), events))
            return
        starts = self._open.get(key)
        if not starts:
            return
        t0, events = starts.pop()
        self.sums[key] = self.sums.get(key, 0.0) + time.perf_counter() - t0
        self.counts[key] = self.counts.get(key, 0) + 1
        if events is not None:
            events[1].record()
            self._events.append(events)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
            return
        self.sums["gc_s"] = self.sums.get("gc_s", 0.0) + time.perf_counter() - self._gc_t0
        self.counts["gc_s"] = self.counts.get("gc_s", 0) + 1
        if info.get("generation") == 2:
            self.counts["gc_full"] = self.counts.get("gc_full", 0) + 1

    def start(self) -> None:
        self.sums, self.counts, self._events = {}, {}, []

    def take(self) -> dict:
        """This round's phases (seconds) and call counts; the copy's GPU time once it is done."""
        out = {k: v for k, v in self.sums.items()}
        if self._events:
            for a, b in self._events:
                b.synchronize()
            out["copy_gpu_s"] = sum(a.elapsed_time(b) for a, b in self._events) / 1e3
        out["counts"] = dict(self.counts)
        return out


def swap_ipcpool(sock: Path, name: str, state: dict, readers: int, kind: str, rounds: int) -> dict:
    """``rounds`` swaps, each from the trainer's first call to the last reader on the new
    version. The first writes fresh memory; from the second on, each writes the spare (the
    version before last, its readers gone): the steady state of a training loop."""
    q_ready, q_out = SPAWN.Queue(), SPAWN.Queue()
    with ipcpool.connect(sock) as c:
        cuda = c.backend == "cuda"
        # A host of few cores: readers polling without pause (and the broker's busy poll after each
        # request) would take the cores the trainer needs.
        poll_s = 0.0 if cuda else 0.005
        procs = [SPAWN.Process(target=_swap_reader, args=(str(sock), name, kind, rounds, poll_s, q_ready, q_out))
                 for _ in range(readers)]
        for p in procs:
            p.start()
        for _ in procs:
            q_ready.get(timeout=300)
        base = c.stats()["pools"]["default"]["used"]
        version_bytes = next(x for x in c.list_checkpoints(name) if x["name"] == name)["versions"][-1]["size"]
        rows = []
        with WriterPhases(cuda and kind == "torch") as phases:
            for _ in range(rounds):
                c.reset_high()
                phases.start()
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
                writer = phases.take()   # (before the stats call below: not the writer's)
                stats = c.stats()
                rows.append({"swap_s": max(m["moved_at"] for m in moved) - t0, "publish_s": published - t0,
                             "used_high": stats["pools"]["default"]["used_high"],
                             "kept_bytes": stats["checkpoints"].get("kept_bytes", 0),
                             "refresh_s": sorted(m["refresh_s"] for m in moved),
                             "reader_polls": sum(m["polls"] for m in moved), "phases": writer})
    for p in procs:
        p.join()
    steady = rows[1:] or rows
    keys = sorted({k for r in steady for k in r["phases"] if k != "counts"})
    return {"swap_s": median([r["swap_s"] for r in steady]), "publish_s": median([r["publish_s"] for r in steady]),
            "first_swap_s": rows[0]["swap_s"], "rounds": rows, "used_before": base, "version_bytes": version_bytes,
            "most_versions_resident": max(r["used_high"] for r in steady) / version_bytes,
            "refresh_s": median([max(r["refresh_s"]) for r in steady]),
            "phases": {k: median([r["phases"].get(k, 0.0) for r in steady]) for k in keys}}


def _ipc_reader(q_in, q_out):
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    torch.empty(1, device="cuda")
    q_out.put("ready")
    handles = q_in.get()
    tensors = {k: rebuild_cuda_tensor(*a) for k, a in handles}
    q_out.put({"done_at": time.monotonic(), "tensors": len(tensors)})
    q_in.get()


def swap_per_tensor_ipc(state: dict, readers: int) -> dict:
    """What RL frameworks do: a handle per tensor, rebuilt one by one in each reader."""
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    with _workers(SPAWN, _ipc_reader, readers) as (qs, q_out, _):
        t0 = time.monotonic()
        new = {k: v.clone() for k, v in state.items()}   # the new version's bytes, as the trainer makes them
        torch.cuda.synchronize()
        handles = [(k, reduce_tensor(t)[1]) for k, t in new.items()]
        for qi in qs:
            qi.put(handles)
        done = [q_out.get(timeout=300) for _ in qs]
        took = max(d["done_at"] for d in done) - t0
    return {"swap_s": took}


def d2d_copy(nbytes: int) -> float:
    """The swap's floor: one device-to-device copy of the version's bytes, flat buffer to flat buffer."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    dst.copy_(src)
    torch.cuda.synchronize()
    took = time.perf_counter() - t0
    del src, dst
    torch.cuda.empty_cache()   # (the swap's versions need the room)
    return took


# -- the run -----------------------------------------------------------------------------------------
def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def run_case(label: str, path: Path, info: dict, sock: Path, backend: str, readers: int, repeat: int,
             rounds: int) -> dict:
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
    step(f"{label}: pinned floor x{repeat}" if cuda else f"{label}: read floor x{repeat}")
    res["load_floor_s"] = median([load_floor(path, info["bytes"], backend) for _ in range(repeat)])
    name = f"bench-{label}"
    with ipcpool.connect(sock) as c:
        c.load_checkpoint(name, path, progress=False)
        step(f"{label}: attach by {readers} workers x{repeat}")
        got = [attach_ipcpool(sock, name, kind, readers) for _ in range(repeat)]
        res["attach_ipcpool_s"] = median([max(g["attach_s"] for g in run) for run in got])
        with c.attach(name, kind=kind) as ck:
            state = {k: v.clone() if kind == "torch" else v.copy() for k, v in ck.tensors.items()}
        if torch is not None:
            step(f"{label}: torch.multiprocessing attach x{repeat}")
            res["attach_torch_mp_s"] = median([max(g["attach_s"] for g in attach_torch_mp(state, readers))
                                               for _ in range(repeat)])
        if cuda:
            step(f"{label}: attach floor (VMM chunk FDs) x{repeat}")
            res["attach_floor_s"] = median([max(g["attach_s"] for g in attach_floor(state, readers))
                                            for _ in range(repeat)])
            res["d2d_copy_s"] = median([d2d_copy(info["bytes"]) for _ in range(max(repeat, 5))])
        step(f"{label}: {rounds} swaps to {readers} readers")
        res.update({f"swap_ipcpool_{k}": v for k, v in swap_ipcpool(sock, name, state, readers, kind, rounds).items()})
        if cuda:
            step(f"{label}: swap by per-tensor CUDA IPC")
            res["swap_per_tensor_ipc_s"] = swap_per_tensor_ipc(state, readers)["swap_s"]
            res["swap_goal_s"] = 2 * res["d2d_copy_s"] + 0.010
        del state
        c.delete_checkpoint(name)
    return res


LABELS = {"load_ipcpool_s": "ipcpool", "load_safetensors_s": "safetensors", "load_floor_s": "floor",
          "attach_ipcpool_s": "ipcpool", "attach_torch_mp_s": "torch.mp", "attach_floor_s": "floor",
          "swap_ipcpool_swap_s": "ipcpool", "swap_ipcpool_first_swap_s": "ipcpool, 1st",
          "swap_per_tensor_ipc_s": "per-tensor IPC", "d2d_copy_s": "floor: d2d copy", "swap_goal_s": "goal: 2x d2d+10ms"}


def plot(results: list[dict], png: Path, device: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = {"load": ["load_ipcpool_s", "load_safetensors_s", "load_floor_s"],
              "attach": ["attach_ipcpool_s", "attach_torch_mp_s", "attach_floor_s"],
              "swap": ["swap_ipcpool_swap_s", "swap_ipcpool_first_swap_s", "swap_per_tensor_ipc_s", "d2d_copy_s",
                       "swap_goal_s"]}
    fig, axes = plt.subplots(len(results), 3, figsize=(13, 3.2 * len(results)), squeeze=False)
    for row, r in zip(axes, results):
        for ax, (g, keys) in zip(row, groups.items()):
            keys = [k for k in keys if k in r]
            ax.bar([LABELS[k] for k in keys], [r[k] * 1e3 for k in keys],
                   color=["tab:blue" if k.startswith(("swap_ipcpool", "load_ipcpool", "attach_ipcpool")) else
                          "tab:gray" if "floor" in k or "d2d" in k or "goal" in k else "tab:orange" for k in keys])
            ax.set_title(f"{r['case']}: {g} (ms)")
            ax.tick_params(axis="x", labelsize=7)
    fig.suptitle(f"ipcpool checkpoints on {device}")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return _worker_main(argv[1], argv[2])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=["auto", "cuda", "host"], default="auto")
    ap.add_argument("--cases", default="small,model", help="small, model, or both (default)")
    ap.add_argument("--model-gib", type=float, default=None, help="the model case's size (default: 8 on CUDA, 1 on the host)")
    ap.add_argument("--model-tensors", type=int, default=320)
    ap.add_argument("--readers", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5, help="swaps in a row (the first writes fresh memory)")
    ap.add_argument("--out", type=Path, default=RESULTS)
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
    pool = '[[pools]]\nname = "default"\nmax_size = "%s"\n' % ("0" if backend == "cuda" else "48G")
    with tempfile.TemporaryDirectory(prefix="ipcpool-weights-") as tmp, broker(backend, pool) as sock:
        for label in chosen:
            path = Path(tmp) / f"{label}.safetensors"
            step(f"{label}: writing {cases[label][0]:g} GiB in {cases[label][1]} tensors")
            info = write_model(path, *cases[label])
            results.append(run_case(label, path, info, sock, backend, args.readers, args.repeat, args.rounds))
            path.unlink()
            print(json.dumps({k: v for k, v in results[-1].items() if k != "swap_ipcpool_rounds"}, indent=1), flush=True)
    dev = gpu_device() if backend == "cuda" else {"device": "host"}
    short = gpu_model(dev["device"]) if backend == "cuda" else "host"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    data = {"benchmark": "weights", "machine": machine(), "device": dev, "backend": backend, "commit": commit,
            "readers": args.readers, "repeat": args.repeat, "rounds": args.rounds, "results": results}
    out = save(f"weights_{short}_{time.strftime('%Y%m%d-%H%M%S')}", data,
               lambda d, png: plot(d["results"], png, dev["device"]), args.out)
    print(f"wrote {out} and its plot", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
