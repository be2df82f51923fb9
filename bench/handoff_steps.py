"""The hand-off's two client steps beside the smallest Python that does the same work, in one run.

- **Writer: create + view + seal** (the fill between them is the caller's). By hand: take the next
  range of an arena imported once, write the create frame into a request ring, take a view made
  once, record an IPC event made once, post the seal-board word, write the seal frame.
- **Reader: get + view of a sealed object** (it asks once the seal is done, so nothing is waited
  for). By hand: find the name in the broker's directory (hash, seqlock, name bytes), write a
  hazard slot, check the entry again (and the seal-board word, where the broker has not marked
  the entry sealed yet), query the seal's event (opened once), take a view made once.

The by-hand steps read the same directory the broker writes and views of the same arenas; their
ring, board word and hazard slot lie in scratch memory (nothing reads them), and the broker never
hears of them. Hand-offs take turns between ipcpool and by hand in blocks, each step right after its
process wakes for it, so both meet the same machine and caches as warm as a run of their own. A by-hand writer round still
hands the reader its object through ipcpool, after its timed steps.

    python bench/handoff_steps.py --backend cuda [--handoffs 1000]
    python bench/handoff_steps.py --backend host

Writes bench/results/handoff_steps_<backend>.json and .png.
"""

from __future__ import annotations

import argparse
import collections
import mmap
import multiprocessing as mp
import queue
import sys
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import broker, machine, paired_bars, save  # noqa: E402
from bench.handoff_peers import SIZE  # noqa: E402
from ipcpool.progress import Progress  # noqa: E402

CTX = mp.get_context("spawn")
WARMUP = 100   # hand-offs left out (both kinds' set-up: arenas, views, events)
# ipcpool and by hand take turns in blocks (each kind's code as warm as in a run of its own, as in
# bench/handoff.py); the first rounds of a block are left out.
BLOCK, SETTLE = 50, 5
POOL = "default"


class _Ring:
    """A request ring's writer side in scratch memory: a frame's length, the frame, the head word."""

    SLOT = 512

    def __init__(self) -> None:
        self._map = mmap.mmap(-1, 3 * mmap.PAGESIZE)
        self._words = memoryview(self._map).cast("Q")
        self._head = 0

    def put(self, frame: bytes) -> None:
        n, head, m = len(frame), self._head, self._map
        at = 128 + (head % 16) * self.SLOT
        m[at: at + 4] = n.to_bytes(4, "little")
        m[at + 4: at + 4 + n] = frame
        self._head = head + 1
        self._words[0] = head + 1


class HandWriter:
    """The writer's steps by hand, on the arena this client's writer carves from."""

    def __init__(self, client, stream) -> None:
        from ipcpool import frames

        self._create, self._seal = frames.create, frames.seal
        arena = client._leases.handoff._arenas[POOL][-1]   # (a bench's look inside: the arena in use)
        self._aid = arena.aid
        self._offsets = collections.deque(range(0, min(arena.memory.size, 4 * SIZE), SIZE))
        self._views = {o: _view(arena.memory, o, SIZE) for o in self._offsets}
        self._ring, self._board = _Ring(), memoryview(mmap.mmap(-1, mmap.PAGESIZE)).cast("Q")
        self._pool, self._seq, self._rid = POOL.encode(), 0, 0
        self._event, self._handle = _ipc_event() if stream is not None else (None, bytes(64))
        self._stream_h = int(stream.cuda_stream) if stream is not None else 0
        if stream is not None:
            from cuda.bindings.driver import cuEventRecord

            self._record = cuEventRecord

    def create(self, name: str) -> int:
        raw, offset = name.encode(), self._offsets[0]
        self._offsets.rotate(-1)
        self._seq += 1
        self._rid += 1
        self._ring.put(self._create(self._rid, self._pool, raw, b"", self._aid, offset, SIZE, 0, self._seq,
                                    self._handle))
        return offset

    def view(self, offset: int):
        return self._views[offset]

    def seal(self, name: str) -> None:
        if self._event is not None:
            self._record(self._event, self._stream_h)
        self._board[0] = self._seq
        self._rid += 1
        self._ring.put(self._seal(self._rid, name.encode(), self._handle))


class HandReader:
    """The reader's steps by hand, on the directory and the arenas this client's reader has."""

    def __init__(self, client, on_gpu: bool) -> None:
        from ipcpool.shm import directory

        self._d = directory
        view, self._pidx = client._leases._pools.directories[POOL]   # (a bench's look inside)
        self._m, self._words, self._cap = view._map, view._words, view.capacity
        self._arenas = client._leases.handoff._arena_views[POOL]
        self._board = client._leases.handoff.boards[POOL]
        self._on_gpu = on_gpu
        if on_gpu:
            from cuda.bindings.driver import CUresult, cuEventQuery

            self._query, self._not_ready = cuEventQuery, CUresult.CUDA_ERROR_NOT_READY
        self._hazard = memoryview(mmap.mmap(-1, mmap.PAGESIZE)).cast("Q")
        self._free, self._nonce = list(range(32)), 0
        self._events: dict[bytes, object] = {}
        self._views: dict[tuple, object] = {}
        self._slot = 0

    def get(self, name: str):
        """A view of sealed object ``name``; None where its arena is not imported here yet."""
        d, m, words = self._d, self._m, self._words
        raw = name.encode()
        n = len(raw)
        home = index = zlib.crc32(raw) % self._cap
        probes, give_up = 0, None
        while True:   # (sealed: its entry is there, or will be once the broker has read the create)
            at = (index + 1) * d.ENTRY
            w = at >> 3
            ver = words[w]
            head = d._HEAD.unpack_from(m, at)   # (the layout's own description: ``shm.directory``)
            if ver & 1 or words[w] != ver:
                continue   # the broker is writing this entry: read it again
            if head[3] == n and head[2] in (d.WRITING, d.SEALED) and m[at + d._NAME_AT: at + d._NAME_AT + n] == raw:
                break
            probes += 1
            if head[2] == d.EMPTY or probes >= d.MAX_PROBE:   # not (yet) there: look again from its home
                give_up = give_up or time.monotonic() + 5.0
                if time.monotonic() > give_up:
                    raise RuntimeError(f"{name!r} is not in the directory")
                index, probes = home, 0
                continue
            index = (index + 1) % self._cap
        gen, state, alloc, offset, size, word, seq, event = (head[1], head[2], head[4], head[5], head[6], head[7],
                                                             head[11], head[12])
        slot = self._slot = self._free.pop()
        self._nonce += 1
        hz, at = self._hazard, 1 + slot * 4
        hz[0] = 32 - len(self._free)
        hz[at] = self._pidx | index << 32
        hz[at + 1] = gen
        hz[at + 2] = self._nonce
        while True:   # the entry again, after the slot: still this object (its state may have moved on)
            ver = words[w]
            if ver & 1:
                continue
            now_gen, state = words[w + 1], d._U32.unpack_from(m, at + 16)[0]
            if words[w] == ver:
                break
        if now_gen != gen:
            raise RuntimeError(f"{name!r} was deleted under the reader")
        if state == d.WRITING:   # sealed, its entry not yet marked so: the seal-board word says
            while self._board.read(word) < seq:
                pass
        if self._on_gpu:
            opened = self._events.get(event)
            if opened is None:
                opened = self._events[event] = _open_event(event)
            while self._query(opened)[0] == self._not_ready:
                pass
        x = self._views.get((alloc, offset, size))
        if x is None:
            arena = self._arenas.get(alloc)
            if arena is None:   # (not imported by ipcpool's reader yet: this round is ipcpool's, untimed)
                self.release()
                return None
            x = self._views[(alloc, offset, size)] = _view(arena, offset, size)
        return x

    def release(self) -> None:
        self._hazard[1 + self._slot * 4 + 2] = 0
        self._free.append(self._slot)


def _view(arena, offset: int, size: int):
    """A view of ``size`` bytes at ``offset`` of an arena import: a uint8 tensor (CUDA), a memoryview (host)."""
    if arena.view is not None:
        return arena.view[offset: offset + size]
    import torch

    return torch.from_dlpack(arena.buffer).view(torch.uint8)[offset: offset + size]


def _ipc_event():
    from cuda.bindings import driver as cu

    flags = int(cu.CUevent_flags.CU_EVENT_INTERPROCESS) | int(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)
    event = cu.cuEventCreate(flags)[1]
    import ctypes

    handle = cu.cuIpcGetEventHandle(event)[1]
    return event, ctypes.string_at(handle.getPtr(), 64)


def _open_event(raw: bytes):
    import ctypes

    from cuda.bindings import driver as cu

    handle = cu.CUipcEventHandle()
    ctypes.memmove(handle.getPtr(), raw, 64)
    return cu.cuIpcOpenEventHandle(handle)[1]


def _stream(backend: str):
    if backend != "cuda":
        return None
    import torch

    torch.cuda.set_device(0)
    stream = torch.cuda.Stream()
    torch.cuda.set_stream(stream)
    return stream


def _by_hand(i: int) -> bool:
    return (i // BLOCK) % 2 == 1


def _timed(i: int) -> bool:
    return i >= WARMUP and i % BLOCK >= SETTLE


def writer(socket_dir, backend, n, go, link, acks, out):
    import ipcpool

    stream = _stream(backend)
    rows: dict[str, list] = {"ipcpool": [], "by hand": [], "ipcpool create": [], "ipcpool view": [], "ipcpool seal": []}
    with ipcpool.connect(socket_dir) as c:
        hand = None
        for i in range(n):
            go.get()
            name = f"s/{i}"
            if _by_hand(i) and hand is not None:
                t0 = time.perf_counter_ns()
                offset = hand.create(name)
                x = hand.view(offset)
                t1 = time.perf_counter_ns()
                hand.seal(name)
                t2 = time.perf_counter_ns()
                del x
                if _timed(i):
                    rows["by hand"].append(t2 - t0)
            t0 = time.perf_counter_ns()
            buf = c.create(name, SIZE, stream=stream)
            t1 = time.perf_counter_ns()
            x = buf.tensor() if stream is not None else buf.view
            t2 = time.perf_counter_ns()
            if stream is not None:
                x.fill_(i % 251)
            else:
                x[0] = i % 251
            del x
            t3 = time.perf_counter_ns()
            buf.seal(stream=stream)
            t4 = time.perf_counter_ns()
            if not _by_hand(i) and _timed(i):
                rows["ipcpool"].append(t4 - t3 + t2 - t0)
                rows["ipcpool create"].append(t1 - t0)
                rows["ipcpool view"].append(t2 - t1)
                rows["ipcpool seal"].append(t4 - t3)
            if hand is None and i >= 2:   # (its arena is carved from by now)
                hand = HandWriter(c, stream)
            link.put(i)
            acks.get()
            c.delete(name)
    out.put(("writer", rows))


def reader(socket_dir, backend, n, go, link, acks, out):
    import ipcpool

    stream = _stream(backend)
    rows: dict[str, list] = {"ipcpool": [], "by hand": []}
    with ipcpool.connect(socket_dir) as c, Progress("hand-offs", n, stream=sys.stdout) as bar:
        hand = None
        for i in range(n):
            go.put(True)
            link.get()   # sealed: nothing to wait for
            name = f"s/{i}"
            x = None
            if _by_hand(i) and hand is not None:
                t0 = time.perf_counter_ns()
                x = hand.get(name)
                t1 = time.perf_counter_ns()
            if x is not None:
                value = int(x[0].item()) if stream is not None else x[0]
                hand.release()
                kind = "by hand"
            else:   # (an ipcpool round, or one in an arena the by-hand reader has not seen imported yet)
                t0 = time.perf_counter_ns()
                lease = c.get(name, stream=stream, timeout=60)
                x = lease.tensor() if stream is not None else lease.view
                t1 = time.perf_counter_ns()
                value = int(x[0].item()) if stream is not None else x[0]
                lease.release(stream=stream)
                kind = "ipcpool"
                if hand is None and i >= 2:   # (its arena is imported by now)
                    hand = HandReader(c, stream is not None)
            del x
            assert value == i % 251, (kind, value, i)
            if _timed(i):
                rows[kind].append(t1 - t0)
            bar.update()
            acks.put(True)
    out.put(("reader", rows))


def run(socket_dir, backend: str, n: int) -> dict:
    go, link, acks, out = CTX.Queue(), CTX.Queue(), CTX.Queue(), CTX.Queue()
    procs = [CTX.Process(target=writer, args=(str(socket_dir), backend, n, go, link, acks, out)),
             CTX.Process(target=reader, args=(str(socket_dir), backend, n, go, link, acks, out))]
    for p in procs:
        p.start()
    got: dict = {}
    while len(got) < len(procs):   # (a process that died says so at once, not after a timeout)
        try:
            who, rows = out.get(timeout=1.0)
            got[who] = rows
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"{dead[0].name} exited with {dead[0].exitcode}") from None
    for p in procs:
        p.join(60)
        if p.exitcode != 0:
            raise RuntimeError(f"{p.name} exited with {p.exitcode}")
    return got


def _p50(xs: list[int]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] / 1000.0


def plot(results: dict, path: Path) -> None:
    steps = results["steps"]
    labels = list(steps)
    paired_bars(path, labels, {"ipcpool": [steps[k]["ipcpool_p50_us"] for k in labels],
                               "by hand": [steps[k]["by_hand_p50_us"] for k in labels]},
                f"hand-off client steps ({results['backend']}, {results.get('device', {}).get('device', 'host')})",
                "p50 µs", across=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("host", "cuda"), default="host")
    parser.add_argument("--handoffs", type=int, default=1000, help="in all, about half of them by hand")
    parser.add_argument("--out-dir", type=Path, default=None, help="where the JSON and PNG go (default bench/results)")
    args = parser.parse_args()
    n = args.handoffs + WARMUP
    results = {"benchmark": "handoff_steps", "backend": args.backend, "machine": machine(),
               "handoffs": args.handoffs, "object_bytes": SIZE}
    if args.backend == "cuda":
        from bench.common import gpu_device

        results["device"] = gpu_device()
    with broker(args.backend, f'[[pools]]\nname = "{POOL}"\nmax_size = "4G"\n') as socket_dir:
        got = run(socket_dir, args.backend, n)
    w, r = got["writer"], got["reader"]
    results["steps"] = {label: {"ipcpool_p50_us": _p50(got["ipcpool"]), "by_hand_p50_us": _p50(got["by hand"]),
                                "ipcpool_n": len(got["ipcpool"]), "by_hand_n": len(got["by hand"])}
                        for label, got in (("writer create+view+seal", w), ("reader get+view (sealed)", r))}
    results["writer_split_p50_us"] = {k.split()[1]: _p50(w[f"ipcpool {k.split()[1]}"]) for k in
                                      ("ipcpool create", "ipcpool view", "ipcpool seal")}
    path = save(f"handoff_steps_{args.backend}", results, plot, *([args.out_dir] if args.out_dir else []))
    print(f"\n{'':<28}{'ipcpool p50':>13}{'by hand p50':>13}{'ratio':>8}")
    for k, v in results["steps"].items():
        print(f"{k:<28}{v['ipcpool_p50_us']:>10.1f} µs{v['by_hand_p50_us']:>10.1f} µs"
              f"{v['ipcpool_p50_us'] / v['by_hand_p50_us']:>7.2f}x")
    split = results["writer_split_p50_us"]
    print(f"ipcpool writer p50: create {split['create']:.1f} µs, view {split['view']:.1f} µs, seal {split['seal']:.1f} µs")
    print(f"-> {path}")


if __name__ == "__main__":
    main()
