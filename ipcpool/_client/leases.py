"""What a client holds, and how it comes and goes: ``Buffer`` (an allocation, an object being
written, or a lease) and the lease table that imports, keeps and releases them: one by one from the
export a reply carries (with the chunk FDs fetched over the control socket where the memory needs
them), or a batch (``get_many``) pool by pool, each pool's set-up and shared event once. Small
creates and allocations are carved without a round trip (``handoff``); the rest wait for the broker.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .. import protocol
from .. import trace
from ..backend.base import ClientBackend, Export, ImportedMemory
from ..errors import BrokerGone, ClosedError, InvalidRequest, IpcPoolError, ObjectExists, ProtocolError
from ..fds import close_all
from ..meta import wire_meta
from ..replies import Allocation, Batch, Lease, Shared
from .channel import Channel
from .handoff import Carving, Handoff
from .interop import Views
from .pools import Pools

_MAX_WAIT_S = protocol.MAX_WAIT_MS / 1000   # the longest timeout a get takes, in seconds


class Buffer:
    """Memory from the broker. Free it (or use ``with``); the client frees leftovers on close."""

    def __init__(self, leases: Leases, alloc_id: int, pool: str, memory: ImportedMemory, owner: bool,
                 *, name: str | None = None, meta: dict | None = None, readonly: bool = False):
        self._leases = leases
        self.alloc_id = alloc_id
        self.pool = pool
        self.memory = memory   # the backend's import (``ImportedMemory``): what interop and views read
        self.owner = owner
        self.name = name
        self.meta = meta or {}
        self.readonly = readonly
        self._freed = False
        # Carved from this client's arena and requested without waiting: the hand-off's record
        # (``handoff.Carving``), which ``handoff`` alone sets and changes.
        self.carving: Carving | None = None
        # Taken from a name directory without a request: (pool index, entry, gen, slot, nonce).
        self.dirlease: tuple[int, int, int, int, int] | None = None
        self.tensor_ahead: Any = None   # its tensor, made ahead off the hand-off's path (``handoff``): tensor() takes it

    def _live(self) -> ImportedMemory:
        if self._freed:
            raise ClosedError("this buffer was freed")
        return self.memory

    @property
    def size(self) -> int:
        return self.memory.size

    @property
    def ptr(self) -> int:
        return self._live().ptr

    @property
    def device(self) -> int | None:
        return self.memory.device

    @property
    def view(self) -> memoryview:
        """A writable memoryview (host backend)."""
        view = self._live().view
        if view is None:
            raise AttributeError("view: only host-backend buffers are CPU-addressable; use DLPack")
        return view.toreadonly() if self.readonly else view

    @property
    def __array_interface__(self) -> dict:
        mem = self._live()
        if mem.view is None:
            raise AttributeError("__array_interface__: not host memory")
        return {"version": 3, "shape": (mem.size,), "typestr": "|u1", "data": (mem.ptr, self.readonly)}

    @property
    def __cuda_array_interface__(self) -> dict:
        cai = self._live().cuda_array_interface
        if cai is None:
            raise AttributeError("__cuda_array_interface__: not CUDA memory")
        # A lease is read-only by contract; the flag stays False because torch refuses any other
        # ("the read only flag is not supported"), as CuPy ignores it.
        return cai

    def __dlpack__(self, **kwargs):
        return self._live().dlpack(**kwargs)

    def __dlpack_device__(self):
        return self._live().dlpack_device()

    def tensor(self) -> Any:
        """This buffer as a torch tensor, zero-copy: its metadata's dtype and shape, else its
        bytes (uint8). On CUDA a slab range is a view of one tensor kept per slab: a few µs, where
        ``torch.from_dlpack`` builds a fresh import each call. Work on it goes on torch's current
        stream: the one given to ``create``/``get`` (or ordered after it by the caller)."""
        self._live()
        made = self.tensor_ahead
        if made is not None:   # the first call's, made ahead
            self.tensor_ahead = None
            return made
        return self._leases.views.tensor(self, self.memory)

    def share(self) -> bytes:
        """A token another session passes to ``Client.open`` to use this memory too. The broker
        frees the memory only once the owner and every opener have freed it."""
        self._live()
        return self._leases.share(self)

    def free(self, stream: Any = None) -> None:
        """Give the memory back (on CUDA: released on ``stream``, freed by the broker after)."""
        if self._freed:
            return
        self._freed = True
        self._leases.free(self, stream)

    close = release = free

    def seal(self, stream: Any = None) -> None:
        """Finish writing a named object: after the work on ``stream``, it is immutable and readers
        may have it. This buffer is given up (``get`` the object to read it again)."""
        if self.name is None or self.readonly:
            raise InvalidRequest("only a buffer from Client.create() can be sealed")
        if self._freed:
            self._live()   # (raises: a check, not a call, on the hand-off's path)
        self._freed = True
        self._leases.seal(self, stream)

    def write(self, data, offset: int = 0, stream: Any = None) -> None:
        """Copy host bytes into this buffer at ``offset`` (on CUDA, ordered on ``stream``)."""
        mem = self._live()
        if self.readonly:
            raise InvalidRequest("this buffer is a read-only lease")
        src = memoryview(data).cast("B")
        if offset < 0 or offset + src.nbytes > mem.size:
            raise ValueError(f"{src.nbytes} bytes at offset {offset} do not fit in {mem.size}")
        mem.copy_from_host(src, offset, self._leases.backend, stream)

    @property
    def freed(self) -> bool:
        return self._freed

    @property
    def refusal(self) -> IpcPoolError | None:
        """The broker's refusal of this buffer's create or allocate, once it is known (it arrives
        after ``create()`` returned for an object carved without a round trip; ``client.flush()``
        waits for it); None while it is accepted or not yet answered."""
        return None if self.carving is None else self.carving.error

    @property
    def carved_at(self) -> tuple[int, int] | None:
        """(arena id, offset) for an object carved from this client's arena (created without a
        round trip), else None."""
        return None if self.carving is None else (self.carving.arena.aid, self.carving.offset)

    def __enter__(self) -> Buffer:
        return self

    def __exit__(self, *exc) -> None:
        self.free()

    def __repr__(self) -> str:
        what = f"object {self.name!r}" if self.name else "buffer"
        return f"<ipcpool.Buffer {what} {self.size} bytes from {self.pool!r}{' (freed)' if self._freed else ''}>"


class Leases:
    """Every buffer a client holds, and the requests that make and release them."""

    def __init__(self, channel: Channel, pools: Pools, backend: ClientBackend, arena_bytes: int):
        self._channel = channel
        self._lock = channel.lock
        self._pools = pools
        self.backend = backend
        self.views = Views(backend.on_gpu)
        self.buffers: dict[int, Buffer] = {}
        self.handoff = Handoff(channel, pools, arena_bytes, self.keep, self.buffers, self.views)
        self._writing: set[str] = set()   # names of objects this client is writing

    # -- importing ----------------------------------------------------------------------------
    def adopt(self, got: Allocation | Lease, stream: Any, owner: bool, *, name: str | None = None,
              meta: dict | None = None, readonly: bool = False, export: Export | None = None) -> Buffer:
        """The memory a reply handed out, imported (from ``export`` where given) and kept."""
        memory = self._import(got.alloc, got.pool, export or got.export, stream)
        return self.keep(got.alloc, got.pool, memory, owner, name, meta, readonly)

    def _import(self, aid: int, pool: str, export: Export, stream: Any, fds: list[int] | None = None) -> ImportedMemory:
        """One allocation imported (a VMM-backed one from its chunk FDs: ``fds``, else fetched); given back on failure."""
        try:
            return self._pools.import_allocation(aid, pool, export, stream, fds)
        except BaseException:
            self._channel.send("free", alloc=aid)   # give it back; nothing was imported
            raise

    def keep(self, aid: int, pool: str, memory: ImportedMemory, owner: bool, name: str | None,
              meta: dict | None, readonly: bool, enter: bool = True) -> Buffer:
        buf = Buffer(self, aid, pool, memory, owner, name=name, meta=meta, readonly=readonly)
        if enter:
            self.buffers[id(buf)] = buf
        return buf

    def hand_over(self, buf: Buffer) -> None:
        """Out of the table and done with here, without a free: the caller's request gives its
        memory back (a checkpoint's publish)."""
        self.buffers.pop(id(buf), None)
        buf._freed = True

    # -- anonymous allocations ----------------------------------------------------------------
    def allocate(self, nbytes: int, pool: str, stream: Any) -> Buffer:
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
            raise InvalidRequest(f"nbytes must be a positive int, got {nbytes!r}")
        with self._lock:
            self._channel.check_open()
            buf = self.handoff.carve("allocate", {"nbytes": nbytes, "pool": pool}, name=None)
            if buf is not None:   # carved from an arena, no round trip
                return buf
            reply = self._channel.call("allocate", nbytes=nbytes, pool=pool)
            return self.adopt(Allocation.decode(reply), stream, owner=True)

    def open(self, token: bytes, stream: Any) -> Buffer:
        with self._lock:
            reply = self._channel.call("open", token=bytes(token))
            return self.adopt(Allocation.decode(reply), stream, owner=False)

    def share(self, buf: Buffer) -> bytes:
        with self._lock:
            self.handoff.settle(buf)
            return Shared.decode(self._channel.call("share", alloc=buf.alloc_id)).token

    # -- named objects --------------------------------------------------------------------------
    def create(self, name: str, nbytes: int, pool: str, meta: dict | None, stream: Any) -> Buffer:
        if not meta:   # a steady writer's next object, made ready at its last seal, if all is as usual
            with self._lock:
                buf = self.handoff.create_ready(name, nbytes, pool, self._writing)
            if buf is not None:
                return buf
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
            raise InvalidRequest(f"nbytes must be a positive int, got {nbytes!r}")
        wire = wire_meta(meta) if meta else None
        with self._lock:
            self._channel.check_open()
            carved = nbytes <= self.handoff.arena_bytes // 4
            if carved or wire is None or type(name) is not str:   # what the broker would refuse, now
                protocol.check_object_name("name", name)
            if name in self._writing:
                raise ObjectExists(f"this client is already writing an object named {name!r}; seal or free it first")
            fields = {"name": name, "nbytes": nbytes, "pool": pool}
            if wire is not None:
                fields["meta"] = wire
                if carved:
                    protocol.check_meta("meta", wire)
            buf = self.handoff.carve("create", fields, name=name)
            if buf is None:
                reply = self._channel.call("create", **fields)
                buf = self.adopt(Allocation.decode(reply), stream, owner=True, name=name, meta=fields.get("meta", {}))
            self._writing.add(name)
            return buf

    def seal(self, buf: Buffer, stream: Any) -> None:
        with self._lock:
            if self._channel.closed:
                self._channel.check_open()   # (raises: a check, not a call, on the hand-off's path)
            try:
                if buf.carving is not None:   # (the usual hand-off: its readers wait for the post in
                    self.handoff.seal(buf, stream)   # there; the book-keeping below can wait for it)
                    return
                # Created with a round trip: the seal waits for its reply as well.
                done = self.handoff.release(buf.pool, buf.memory, stream)
                self._channel.call("seal", name=buf.name, alloc=buf.alloc_id, **({"done_event": done} if done else {}))
            finally:
                self.buffers.pop(id(buf), None)
                self._writing.discard(buf.name)

    def get(self, name: str, stream: Any, timeout: float | None) -> Buffer:
        # Checked before anything is read or sent (nan, inf and negatives compare False here).
        if timeout is not None and (not isinstance(timeout, (int, float))
                                    or not 0 <= timeout <= _MAX_WAIT_S):
            raise InvalidRequest(f"get: timeout is None (wait without limit) or 0 to "
                                 f"{protocol.MAX_WAIT_MS // 1000} seconds, got {timeout!r}")
        with self._lock:
            if self._channel.closed:
                self._channel.check_open()   # (raises: as ``seal``)
            buf = self.handoff.look(name, stream, timeout)   # from a directory: no request at all
            if buf is not None:
                return buf
            fields: dict[str, Any] = {"name": name}
            if timeout is not None:
                fields["timeout_ms"] = int(timeout * 1000)
            lease = Lease.decode(self._channel.call("get", _wait=timeout, **fields))
            if not lease.pending:
                return self.adopt(lease, stream, owner=False, name=name, meta=lease.meta, readonly=True)
            # Answered before the seal: the memory now (nothing to wait for in its import), the
            # seal from the board (handoff).
            e = lease.export
            buf = self.adopt(lease, stream, owner=False, name=name, meta=lease.meta, readonly=True,
                             export=Export(e.size, e.offset, e.data, b"", e.sub, e.chunks))
            self.handoff.await_seal(buf, lease, stream, timeout)
            return buf

    def get_many(self, names: list[str], stream: Any) -> list[Buffer]:
        names, out = list(names), []
        batches = _batches(names)
        if not batches:
            return out
        with self._lock:
            channel = self._channel
            channel.check_open()
            # One batch ahead where a reply names no event (one lives until our next message, R4):
            # the broker builds the next reply while this one is imported. It is asked for once
            # this one's pools and FDs are here (``adopt_batch``): the broker answers the control
            # socket only after the requests queued ahead.
            rids = [channel.send("get_many", names=batches[0])]
            answered = 0
            try:
                for k, batch in enumerate(batches):
                    answered += 1   # (a refusal is this reply too)
                    got = Batch.decode(channel.wait_reply(rids[k], channel.timeout))
                    more = k + 1 < len(batches)
                    def ask_next() -> None:   # (called within this turn of the loop)
                        rids.append(channel.send("get_many", names=batches[k + 1]))
                    # After a reply that names an event, the next batch only once this one is imported.
                    self.adopt_batch(got, batch, stream, out, ask_next if more and not any(got.events) else None)
                    if more and len(rids) == k + 1:
                        ask_next()
            except BaseException as exc:
                for buf in out:
                    buf.free(stream)
                # Not on an interrupt (it must not wait on the broker), nor with the broker gone.
                if isinstance(exc, Exception) and not isinstance(exc, (BrokerGone, ClosedError)):
                    self._give_back(rids[answered:])
                raise
        return out

    def _give_back(self, rids: list[int]) -> None:
        """After a failed batch: the leases of those asked after it go straight back."""
        for rid in rids:
            try:
                reply = self._channel.wait_reply(rid, self._channel.timeout)
            except (BrokerGone, ClosedError):
                return
            except IpcPoolError:   # refused: nothing held
                continue
            for aid in Batch.decode(reply).alloc:
                self._channel.send("free", alloc=aid)

    def adopt_batch(self, r: Batch, names: list[str], stream: Any, out: list[Buffer],
                    ahead: Callable[[], None] | None = None) -> None:
        """Import a batch of leases (columns, see ``replies.Batch``) pool by pool: each pool's
        set-up and its one shared event once. VMM-backed ones are mapped from their own FDs, all
        of the batch's in one round trip. ``ahead`` (asking for the next batch) is called once the
        pools and FDs are here: the broker answers the control socket only after the requests
        queued before it, so the next batch asked for earlier would hold up this one's FDs."""
        n = len(names)
        cols = r.columns()
        if any(len(c) != n for c in cols):
            raise ProtocolError("get_many reply: columns do not match the names asked for")
        aids, pool_col, sizes, offsets, data_col, subs, chunks, metas = cols
        pools, events, datas = r.pools, r.events, r.datas
        if n and pool_col.count(pool_col[0]) == n:   # the usual batch: one pool
            by_pool: dict[int, Any] = {pool_col[0]: range(n)}
        else:
            by_pool = {}
            for i in range(n):
                by_pool.setdefault(pool_col[i], []).append(i)
        slots: list[Buffer | None] = [None] * n
        settled = [False] * n   # imported, or given back already
        fds: dict[int, list[int]] = {}
        def lease(i: int, pool: str, memory: ImportedMemory) -> Buffer:
            settled[i] = True
            return Buffer(self, aids[i], pool, memory, False, name=names[i], meta=metas[i], readonly=True)

        try:
            plan = []   # per pool: its name, its import, the batch's indices, exports, those with FDs
            for p, idx in by_pool.items():
                pool, event = pools[p], events[p]
                client_pool = self._pools.get(pool)
                exports = {i: Export(sizes[i], offsets[i], datas[data_col[i]], event, subs[i], tuple(chunks[i]))
                           for i in idx}
                # With FDs: memory of chunks of its own, a VMM slab's first range here; the rest in a batch.
                first: dict[Any, int] = {}
                for i in (i for i in idx if client_pool.needs_fds(exports[i])):
                    first.setdefault(exports[i].data if subs[i] else i, i)
                plan.append((pool, client_pool, idx, exports, list(first.values())))
            fds = self._channel.allocs_fds([(aids[i], len(ex[i].chunks)) for *_, ex, firsts in plan for i in firsts])
            if ahead is not None:
                ahead()
            for pool, client_pool, idx, exports, firsts in plan:
                for i in firsts:
                    settled[i] = True   # _import gives it back itself if it fails
                    slots[i] = lease(i, pool, self._import(aids[i], pool, exports[i], stream, fds.pop(aids[i])))
                rest = [i for i in idx if slots[i] is None]
                for i, memory in zip(rest, client_pool.import_many([exports[i] for i in rest], stream) if rest else ()):
                    slots[i] = lease(i, pool, memory)
        except BaseException:
            for i in range(n):   # leases never imported go back now; the caller frees the rest
                if not settled[i]:
                    self._channel.send("free", alloc=aids[i])
            raise
        finally:
            close_all(fd for got in fds.values() for fd in got)
            kept = [b for b in slots if b is not None]
            self.buffers.update({id(b): b for b in kept})
            out.extend(kept)

    # -- as tensors and arrays ------------------------------------------------------------------
    def typed(self, lease: Buffer, kind: str) -> Any:
        """A lease as its dtype and shape (``interop.Views.typed``)."""
        return self.views.typed(lease, lease.memory, kind)

    def typed_many(self, leases: list[Buffer], kind: str) -> dict[str, Any]:
        """Leases as their dtypes and shapes, by name; on failure every one is freed. On CUDA,
        ranges of one slab are strided views of one tensor over the slab: how a restarted worker
        takes up a thousand weights."""
        if trace.hook is not None:
            trace.emit("client.views", count=len(leases), kind=kind)
        try:
            return self.views.typed_many(leases, [lease.memory for lease in leases], kind)
        except BaseException:
            for lease in (x for x in leases if not x.freed):
                lease.free()
            raise

    # -- releasing ------------------------------------------------------------------------------
    def free(self, buf: Buffer, stream: Any) -> None:
        with self._lock:
            self.buffers.pop(id(buf), None)
            # A create's buffer given up before its seal: the free names it, and the broker aborts
            # the object (its readers are told; the name is free again).
            abandoned = buf.name if buf.owner and buf.name in self._writing else None
            self._writing.discard(abandoned)
            if self._channel.closed or self.handoff.free(buf, stream, abandoned):   # carved: freed by where it lies
                return
            if buf.dirlease is not None:   # taken from a directory: its release names its slot
                self.handoff.end_lease(buf, stream)
                return
            done = self.handoff.release(buf.pool, buf.memory, stream, if_busy=True)
            self.handoff.send_free(abandoned, alloc=buf.alloc_id, **({"done_event": done} if done else {}))

    def release_all(self, name: str, stream: Any) -> int:
        leases = [b for b in self.buffers.values() if b.name == name and b.readonly]
        for b in leases:
            b.free(stream)
        return len(leases)

    def free_all(self) -> None:
        """Free every buffer still held (at close), and give back a carve made ready."""
        for buf in list(self.buffers.values()):
            buf.free()
        self.handoff.unprepare()


_ROOM = protocol.MAX_MESSAGE - 256   # a get_many request's bytes for its names (the rest: its other fields)


def _batches(names: list[str]) -> list[list[str]]:
    """``names`` cut into get_many requests: at most MAX_BATCH names, and a request within
    MAX_MESSAGE bytes (a name packs to its length and a few bytes more). The usual attach fits one
    request even at 4 bytes a character: that bound is summed without a name encoded (~40 µs for
    a thousand names on a 2-CPU host, where counting each name's bytes takes ~270), and the names
    are counted only where it does not hold."""
    if not names:
        return []
    if len(names) <= protocol.MAX_BATCH:
        try:
            if 4 * sum(map(len, names)) + 3 * len(names) <= _ROOM:
                return [names]
        except TypeError:   # (not all names: counted below, and refused by the broker)
            pass
    return _counted_batches(names)


def _counted_batches(names: list[str]) -> list[list[str]]:
    """``_batches``, each name's packed length counted."""
    room = _ROOM
    out: list[list[str]] = []
    batch: list[str] = []
    size = 0
    for name in names:
        cost = len(name.encode()) + 3 if isinstance(name, str) else 0
        if batch and (len(batch) >= protocol.MAX_BATCH or size + cost > room):
            out.append(batch)
            batch, size = [], 0
        batch.append(name)
        size += cost
    if batch:
        out.append(batch)
    return out
