"""The growable buffers a client has attached: ``GrowableBuffer``, the caller's handle on one,
and ``Growables``, the table of them and the requests that make, grow and map them.

Growth never copies. Where the address range right after the buffer is free the new chunks are
mapped there and the pointer stays; otherwise every chunk is mapped again at a new range and the
pointer moves. ``grow`` and ``sync`` return a ``Remap`` that says which happened. The old range
stays mapped (same memory) until ``close``, so work already queued on the old pointer is safe.

``sync()`` (also run by ``view`` and ``__cuda_array_interface__``) maps what other processes grew
before the next use. It never depends on the broker's notice of a grow having arrived: the grower's
reply comes on its control socket, the notice on ours, and the grower may tell this process to use
the new bytes before the notice gets here. On the host the memfd this process holds is as long as
the buffer, so sync reads its length. On CUDA sync reads the buffer's word on the growth board
(``ipcpool.shm.growboard``: mapped read-only, stamped by the broker at every grow before it answers
the grower): while it holds the stamp of this process's last mapping (from the last reply about
the buffer) nothing grew and sync returns at once; else it asks the broker (one round trip, whose
reply carries the FDs of the chunks this process lacks and the stamp to keep). A buffer without a
word (the board was full) or a session without a board asks at every sync.
Ordering of reads and writes across processes is the caller's, as for any shared buffer.

Round trips: create, attach and grow are each one request on the control socket, whose reply
carries the FDs of the chunks this process lacks (the session's first one also the growth board's).
Following another process's grow costs no request where the backend maps from what it already
holds (host: the one memfd, now longer); on CUDA each new chunk is an FD of its own, and a sync
after a grow is one request (more only past FD_BATCH new chunks), a sync with nothing grown none.
On CUDA a create or grow reply also lends the broker's stock of chunks (``loans``): a grow they
add up to maps them while the broker records it, and its reply carries no chunk FD. A create
reserves its mapping's address space while the broker makes the buffer.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..backend.base import ClientBackend, ClientGrowable
from ..errors import ClosedError, InvalidRequest, IpcPoolError, ProtocolError
from ..fds import close_all
from ..replies import GrowableState, GrowNotice
from ..shm.growboard import BoardView
from ..sizes import round_up
from .channel import Channel
from .loans import ChunkLoans


@dataclass(frozen=True)
class Remap:
    """What a grow or sync did to this process's mapping."""

    grown: bool     # new chunks were mapped
    moved: bool     # the pointer changed: use ``ptr`` from now on (the old one stays valid until close)
    ptr: int
    size: int
    old_ptr: int


class GrowableBuffer:
    def __init__(self, growables: Growables, state: GrowableState, mapping: ClientGrowable):
        self._growables = growables
        self._mapping = mapping
        self.name: str = state.name
        self.pool: str = str(state.pool or "")
        info = state.info or {}
        self.device: int = int(info.get("device", -1))
        self.granularity: int = int(info.get("granularity", 0))
        self.compression: bool = bool(info.get("compression"))   # what the memory actually has
        self.compression_requested: bool = bool(state.compression_requested)
        self.generation = -1     # of the chunks mapped here
        self._announced = (state.gen, state.size, len(state.chunks))   # the newest we were told of
        self._chunks = 0
        self._closed = False
        word = state.word   # on the growth board; -1: none (the board was full)
        self._word = word if isinstance(word, int) and not isinstance(word, bool) else -1
        self._stamp: int | None = None   # the word's stamp as of the last mapping from a reply

    # -- state
    @property
    def ptr(self) -> int:
        """The start of the mapping (as of the last grow or sync)."""
        self._check()
        return self._mapping.ptr

    @property
    def size(self) -> int:
        return self._mapping.size

    @property
    def reserved(self) -> int:
        """Address space reserved at ``ptr``: growth up to here never moves the pointer."""
        return self._mapping.reserved

    @property
    def closed(self) -> bool:
        return self._closed

    def _check(self) -> None:
        if self._closed:
            raise ClosedError(f"growable buffer {self.name!r} is closed")

    # -- following growth
    def grow(self, nbytes: int) -> Remap:
        """Grow to at least ``nbytes`` (rounded up to the granularity); a smaller size is a no-op."""
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
            raise InvalidRequest(f"nbytes must be a positive int, got {nbytes!r}")
        self._check()
        return self._growables.grow(self, nbytes)

    def sync(self) -> Remap:
        """Map whatever other processes grew since the last call."""
        self._check()
        return self._growables.sync(self)

    def _stamped(self, state: GrowableState) -> None:
        """Mapped as of ``state``: its stamp is the one a later sync compares the word with."""
        stamp = state.stamp
        self._stamp = stamp if isinstance(stamp, int) and not isinstance(stamp, bool) else None

    def _announce(self, gen: int, size: int, chunks: int) -> None:
        if gen > self._announced[0]:
            self._announced = (gen, size, chunks)

    def _map_to(self, gen: int, size: int, nchunks: int, fetch: _Fetch) -> Remap:
        """Map until ``size`` bytes (``nchunks`` chunks) are mapped: from what this process holds
        where the backend can, else from the FDs ``fetch(first)`` gives with their chunks' sizes."""
        old_ptr, old_size, moved = self._mapping.ptr, self._mapping.size, False
        if self._mapping.size:
            # The host maps its memfd as long as it is now: a grow another process was answered
            # for is seen even before its notice arrives. (Its chunk count then only feeds the
            # ``first`` of a later request, whose FDs the host does not need: it follows again.)
            local = self._mapping.follow(size)
            if local is not None:
                moved, self._chunks = local, max(self._chunks, nchunks)
        while self._mapping.size < size:
            chunks, fds = fetch(self._chunks)
            if not chunks:
                for fd in fds:
                    os.close(fd)
                raise InvalidRequest(f"growable buffer {self.name!r}: the broker sent no chunks")
            moved |= self._mapping.extend(chunks, fds)
            self._chunks += len(chunks)
        self.generation = max(self.generation, gen)
        moved = moved and old_ptr != 0
        return Remap(self._mapping.size > old_size, moved, self._mapping.ptr, self._mapping.size, old_ptr)

    # -- access
    def view(self) -> memoryview:
        """The bytes, on the host backend (after a sync)."""
        self.sync()
        view = self._mapping.view()
        if view is None:
            raise InvalidRequest("view() is for host memory; on CUDA use ptr, CAI or DLPack")
        return view

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        if self.device < 0:
            raise AttributeError("host memory has no __cuda_array_interface__")
        self.sync()
        return {"version": 3, "shape": (self.size,), "typestr": "|u1", "data": (self.ptr, False),
                "strides": None, "stream": None}

    # -- lifetime
    def close(self) -> None:
        """Unmap (CUDA: after this device's work has finished) and detach."""
        if self._closed:
            return
        self._closed = True
        self._growables.detach(self)

    def delete(self) -> None:
        """Delete the name; the memory goes once every attached process has closed it."""
        self._growables.delete(self.name)

    def __enter__(self) -> GrowableBuffer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"ptr=0x{self._mapping.ptr:x} size={self.size}"
        return f"<GrowableBuffer {self.name!r} {state} gen={self.generation}>"


def _step(g: GrowableBuffer, nbytes: int) -> int:
    """The bytes a grow to ``nbytes`` adds (the broker rounds up to the granularity)."""
    return max(0, round_up(nbytes, max(g.granularity, 1)) - g._mapping.size)


class _Fetch:
    """Chunk FDs for ``GrowableBuffer._map_to``: those a reply carried, then more from the control
    socket a batch at a time. ``close`` closes what the mapping did not need."""

    def __init__(self, channel: Channel, name: str, batch: Sequence[int] = (), fds: Sequence[int] = ()):
        self._channel = channel
        self._name = name
        self._batch, self._fds = list(batch), list(fds)

    def __call__(self, first: int) -> tuple[list[int], list[int]]:
        if self._fds:
            got, self._batch, self._fds = (self._batch, self._fds), [], []
            return got
        return self._channel.chunk_fds(first, growable=self._name)

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []


class _ReadReplyOnFailure:
    """Work between a request and its reply: where it fails, the reply is still read (and
    dropped), so that the next request on the control socket gets its own. (A grow the broker
    made meanwhile is mapped by the next grow or sync, from the broker's FDs.) A class: entered
    on every grow, where a generator based context manager costs several times as much."""

    __slots__ = ("_growables",)

    def __init__(self, growables: Growables):
        self._growables = growables

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, tb) -> bool:
        if kind is not None:
            with contextlib.suppress(IpcPoolError):
                for fd in self._growables._reply()[1]:
                    os.close(fd)
        return False


class Growables:
    """The growable buffers a client has attached, and the requests that make, grow and map them."""

    def __init__(self, channel: Channel, backend: ClientBackend, span: int | None = None):
        self._channel = channel
        self._backend = backend
        self._span = span   # address space to reserve per buffer (Settings.growable_span)
        self.attached: dict[str, GrowableBuffer] = {}
        self._board: BoardView | None = None   # the broker's growth board, read-only (see sync)
        self._board_fd: int | None = None       # its FD, until the first sync maps it
        self._loans = ChunkLoans(backend)   # chunks lent ahead of our grows (broker.loans)
        self._lent: list[tuple] = []        # what replies lent, until _keep_lent adds it there

    def create(self, name: str, nbytes: int, pool: str, compression: bool) -> GrowableBuffer:
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
            raise InvalidRequest(f"nbytes must be a positive int, got {nbytes!r}")
        with self._channel.lock:
            self._check_unattached(name)
            self._channel.settle()   # after our earlier requests; its growth notices must reach us
            self._channel.control_send(
                {"op": "grow_create", "name": name, "nbytes": nbytes, "pool": pool, "compression": bool(compression)})
            device = self._channel.pool_devices.get(pool)
            # The mapping is made (its address space reserved) while the broker makes the buffer.
            with _ReadReplyOnFailure(self):
                prepared = None if compression or device is None else self._backend.prepare_growable(device, self._span)
            try:
                reply, fds = self._reply()
            except BaseException:
                if prepared is not None:
                    prepared.close()
                raise
            return self._attach(reply, fds, prepared)

    def attach(self, name: str) -> GrowableBuffer:
        with self._channel.lock:
            self._check_unattached(name)
            self._channel.settle()
            return self._attach(*self._control({"op": "grow_attach", "name": name}))

    def grow_named(self, name: str, nbytes: int) -> Remap:
        g = self.attached.get(name)
        if g is None:
            raise InvalidRequest(f"this client is not attached to growable buffer {name!r}")
        return g.grow(nbytes)

    def delete(self, name: str) -> None:
        self._channel.call("grow_delete", name=name)

    def _control(self, msg: dict) -> tuple[GrowableState, list[int]]:
        """A growable request on the control socket and its reply (see ``_reply``)."""
        self._channel.control_send(msg)
        return self._reply()

    def _reply(self) -> tuple[GrowableState, list[int]]:
        """A growable reply, less the FDs kept here: the growth board's, kept from the first reply
        that carries it (its first FD), and those of chunks lent (its last ones, ``lend``: added
        to the loans by ``_keep_lent`` where they are next used or ended, off this reply's path)."""
        msg, fds = self._channel.control_recv()
        try:
            reply = GrowableState.decode(msg)
        except (KeyError, TypeError) as exc:
            close_all(fds)
            raise ProtocolError(f"a growable reply without its state: {exc}") from None
        lent = reply.lend
        if isinstance(lent, list) and lent and fds:
            n = min(len(lent), len(fds))
            fds, lent_fds = fds[: len(fds) - n], fds[len(fds) - n :]
            device = (reply.info or {}).get("device", -1)
            self._lent.append((str(reply.pool or ""), device if isinstance(device, int) else -1, lent, lent_fds))
        if reply.board and fds:
            fd = fds.pop(0)
            if self._board is None and self._board_fd is None:
                self._board_fd = fd   # mapped at the first sync (a process that only grows never reads it)
            else:
                os.close(fd)
        return reply, fds

    def _keep_lent(self) -> None:
        while self._lent:
            self._loans.add(*self._lent.pop(0))

    def board(self) -> BoardView | None:
        """The growth board, mapped at first use; None where the session has none (or what came
        is no sealed board): every sync asks then."""
        if self._board_fd is not None:
            self._board, self._board_fd = BoardView.open(self._board_fd), None
        return self._board

    def _unchanged(self, g: GrowableBuffer) -> bool:
        """Has the buffer's word on the growth board kept the stamp of this process's last mapping?"""
        board = self.board()
        return board is not None and g._stamp is not None and board.read(g._word) == g._stamp

    def _check_unattached(self, name: str) -> None:
        if name in self.attached:
            raise InvalidRequest(f"this client is already attached to growable buffer {name!r}")

    def _attach(self, reply: GrowableState, fds: list[int], prepared: ClientGrowable | None = None) -> GrowableBuffer:
        name = reply.name
        fetch = _Fetch(self._channel, name, reply.batch or (), fds)
        mapping = None
        try:
            if prepared is not None and not prepared.matches(reply.info):
                prepared.close()
                prepared = None
            mapping = prepared or self._backend.import_growable(reply.info, self._span)
            g = GrowableBuffer(self, reply, mapping)
            g._map_to(reply.gen, reply.size, len(reply.chunks), fetch)
            g._stamped(reply)
        except BaseException:
            fetch.close()
            if mapping is not None:
                mapping.close()   # what was mapped so far
            self._channel.call("grow_detach", name=name)
            raise
        fetch.close()
        self.attached[name] = g
        return g

    def grow(self, g: GrowableBuffer, nbytes: int) -> Remap:
        with self._channel.lock:
            self._channel.check_open()
            self._channel.settle()   # a free sent just before must be counted before this grow
            msg = {"op": "grow", "name": g.name, "nbytes": nbytes, "first": g._chunks}
            self._keep_lent()
            plan = [] if g.compression else self._loans.plan(g.pool, _step(g, nbytes))
            if not plan:
                return self._apply(g, *self._control(msg))
            # Grow by loaned chunks: imported and mapped while the broker records the grow.
            msg["loan"] = [c.lid for c in plan]
            self._channel.control_send(msg)
            with _ReadReplyOnFailure(self), g._mapping.on_device():
                handles = self._loans.import_handles(plan)
                ahead = g._mapping.map_ahead(handles) if handles else None
            try:
                reply, fds = self._reply()
            except BaseException:
                g._mapping.drop(ahead)
                self._loans.release(g.device, handles)
                raise
            took = bool(reply.took)
            if took:
                self._loans.taken(g.pool, plan)
            if not took or handles is None:   # another process grew it first, or no import:
                g._mapping.drop(ahead)         # mapped as without a loan (from the broker's FDs)
                self._loans.release(g.device, handles)
                return self._apply(g, reply, fds)
            old_ptr = g._mapping.ptr
            try:
                moved = g._mapping.keep(handles, ahead)
            except IpcPoolError:   # not mapped: from the broker's FDs, as without a loan
                self._loans.release(g.device, handles)
                return self._apply(g, reply, fds)
            g._chunks += len(plan)
            return self._apply(g, reply, fds, moved=moved and old_ptr != 0, old_ptr=old_ptr)

    def sync(self, g: GrowableBuffer) -> Remap:
        with self._channel.lock:
            self._channel.drain()
            if g._mapping.follows:   # the host: the memfd it holds is as long as the buffer
                return g._map_to(*g._announced, _Fetch(self._channel, g.name))
            # CUDA: a notice is no proof of the size. Another process's grow may have been
            # answered (on its control socket) before our notice of it arrives here, and that
            # process may already have told ours to use the new bytes. The broker stamps the
            # buffer's word on the growth board before it answers a grow: while the word holds
            # the stamp of our last mapping nothing grew; else ask the broker.
            self._channel.check_open()
            if self._unchanged(g):
                ptr = g._mapping.ptr
                return Remap(False, False, ptr, g._mapping.size, ptr)
            reply, fds = self._control({"op": "grow_sync", "name": g.name, "first": g._chunks})
            g._announce(reply.gen, reply.size, len(reply.chunks))
            return self._apply(g, reply, fds)

    def _apply(self, g: GrowableBuffer, reply: GrowableState, fds: list[int], moved: bool = False,
               old_ptr: int | None = None) -> Remap:
        """Map what a grow or sync reply says the buffer now is (its FDs first, then any more it
        needs), and keep the reply's stamp. ``moved`` and ``old_ptr``: what a grow by loaned
        chunks, mapped before, did."""
        if not fds and g._mapping.size >= reply.size and not g._mapping.follows:
            # Mapped already (a grow by loaned chunks, a sync that found nothing new): the
            # mapping, its FDs and _map_to's bookkeeping are skipped on every step.
            g.generation = max(g.generation, reply.gen)
            g._stamped(reply)
            ptr = g._mapping.ptr
            old = ptr if old_ptr is None else old_ptr
            return Remap(old_ptr is not None, moved and old_ptr != 0, ptr, g._mapping.size, old)
        fetch = _Fetch(self._channel, g.name, reply.batch or (), fds)
        try:
            remap = g._map_to(reply.gen, reply.size, len(reply.chunks), fetch)
        finally:
            fetch.close()
        g._stamped(reply)
        if old_ptr is None:
            return remap
        return Remap(True, moved or remap.moved, remap.ptr, remap.size, old_ptr)

    def detach(self, g: GrowableBuffer) -> None:
        with self._channel.lock:
            self.attached.pop(g.name, None)
            g._mapping.close()   # unmapped before the broker may release a chunk
            if not self._channel.closed:
                self._channel.call("grow_detach", name=g.name)
            if not any(o.pool == g.pool for o in self.attached.values()):
                self._keep_lent()
                self._loans.end(g.pool)   # as the broker ends it: our last buffer of the pool

    def on_grown(self, note: dict) -> None:
        """The broker's notice that another process grew a buffer: ``sync`` maps it later."""
        grown = GrowNotice.decode(note)
        g = self.attached.get(grown.growable)
        fields = [grown.gen, grown.size, grown.chunks]
        if g is not None and all(isinstance(v, int) and not isinstance(v, bool) for v in fields):
            g._announce(*fields)

    def close_all(self) -> None:
        """Close every attached buffer (at close)."""
        try:
            for g in list(self.attached.values()):
                g.close()
        finally:
            self._keep_lent()
            self._loans.end_all()
            if self._board_fd is not None:
                os.close(self._board_fd)
                self._board_fd = None
            if self._board is not None:
                self._board.close()
                self._board = None
