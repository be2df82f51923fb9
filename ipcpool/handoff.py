"""A client's side of a hand-off: carve, seal, wait, board. No step of a writer waits for the broker.

- **Carve.** Objects (and anonymous allocations) of up to a quarter of ``arena_bytes`` are carved
  here from pool memory this client holds (arenas of 1 MiB first, doubling up to ``arena_bytes``), so ``create``/``allocate`` send their request without
  waiting; the broker mirrors and checks every range (``broker/handoff.py``) and says when a range
  is idle again (``reclaim``). A refusal arrives later: it is kept, the range comes back once the
  work queued on it has finished, and the error is raised by the client's next ``create``,
  ``allocate``, ``seal`` or ``flush``.
- **Seal.** A carved object has a word on its pool's seal board and, on CUDA, an event of the
  broker's (a credit) it promised in its create to record its seal on. ``seal`` records, posts
  the word, and sends the seal without waiting.
- **Wait.** A reader whose ``get`` the broker answered *pending* (it already has the object's
  memory and the promised event) spins on the board word, then sleeps until the broker's notice,
  and orders its work after the event by querying it on the host (``ClientPool.order_after``).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import time
from typing import TYPE_CHECKING, Any

from . import board as boards
from .backend.allocator import RangeAllocator
from .backend.base import ClientPool, Export, ImportedMemory
from .errors import InvalidRequest, IpcPoolError, ObjectAborted, OutOfMemory, ProtocolError, WaitTimeout, error_from_wire
from .protocol import ARENA_ALIGN, HANDLE_BYTES, MAX_ARENAS

if TYPE_CHECKING:
    from .buffer import Buffer
    from .client import Client

log = logging.getLogger(__name__)


def env_us(name: str, default: int) -> float:
    """A duration in µs from the environment, in seconds (read when a client connects)."""
    return int(os.environ.get(name, str(default))) / 1e6


MIN_ARENA = 1 << 20


def default_arena_bytes() -> int:
    """Bytes of one arena (the broker may grant less); 0 turns arenas off."""
    return int(os.environ.get("IPCPOOL_ARENA_BYTES", str(32 << 20)))


class ClientArena:
    """Pool memory this client carves from, and its block of the pool's seal board."""

    def __init__(self, aid: int, pool: ClientPool, memory: ImportedMemory, words: int | None):
        self.aid = aid
        self.pool = pool
        self.memory = memory
        self.ranges = RangeAllocator(memory.size, ARENA_ALIGN)   # the broker rounds alike
        self.words = words   # the first word of its board block, or None (no block left)
        self._slots = list(range(boards.BLOCK - 1, -1, -1)) if words is not None else []
        self._seq = 0
        self._cooling: list[tuple[int, Any]] = []   # refused ranges, until their work finished

    def carve(self, nbytes: int) -> int | None:
        """An offset for ``nbytes``, or None when the arena has no room."""
        if self._cooling:
            self._cool()
        try:
            return self.ranges.allocate(nbytes)
        except OutOfMemory:
            return None

    def slot(self) -> tuple[int, int] | None:
        """A free board word of this arena and the next number (numbers only grow)."""
        if not self._slots:
            return None
        self._seq += 1
        return self._slots.pop(), self._seq

    def free_slot(self, slot: int) -> None:
        self._slots.append(slot)

    def memory_at(self, offset: int, nbytes: int) -> ImportedMemory:
        return self.pool.carved(self.memory, offset, nbytes)

    def reclaimed(self, offset: int) -> None:
        """The broker says the range at ``offset`` is idle: every importer is done with it."""
        if self.ranges.taken(offset):   # (a stale notice of a refused range: never taken)
            self.ranges.free(offset)

    def refused(self, offset: int, stream: Any) -> None:
        """The broker never took this range: free it here once the work on ``stream`` is done."""
        self._cooling.append((offset, self.pool.idle_marker(stream)))

    def _cool(self) -> None:
        keep = []
        for offset, marker in self._cooling:
            if marker is None or marker.is_done:
                self.ranges.free(offset)
                if marker is not None:
                    marker.close()
            else:
                keep.append((offset, marker))
        self._cooling = keep


@dataclasses.dataclass(slots=True)
class Carving:
    """A buffer carved here: where, its request (until the reply), and its board word."""

    arena: ClientArena
    offset: int
    rid: int
    slot: int | None = None
    seq: int = 0
    promise: bytes = b""        # the credit its seal will be recorded on (CUDA)
    error: IpcPoolError | None = None
    stream: Any = None          # where its last work was queued (a refusal frees it after)
    sent: bool = False          # its seal (or free) went out before the reply came


class Handoff:
    def __init__(self, client: Client, arena_bytes: int):
        self._client = client
        self.arena_bytes = arena_bytes
        self.get_spin_s = env_us("IPCPOOL_GET_SPIN_US", 1000) if client.spin_s else 0.0
        self.boards: dict[str, boards.Board] = {}
        self._arenas: dict[str, list[ClientArena]] = {}   # per pool
        self._no_arena: dict[str, float] = {}             # pool -> when to ask for an arena again
        self._by_arena: dict[int, ClientArena] = {}
        self._inflight: dict[int, Buffer] = {}   # pipelined creates/allocates by request id
        self._sealing: dict[int, Buffer] = {}    # pipelined seals by request id
        self._deferred: collections.deque[IpcPoolError] = collections.deque()   # refusals to raise
        self._credits: dict[str, collections.deque[bytes]] = {}   # the broker's events, per pool
        self._notes: dict[int, dict | None] = {}   # pending leases watched: alloc -> its notice

    # -- what arrives from the broker --------------------------------------------------------------
    def on_notice(self, note: dict) -> bool:
        """A reclaim, or the seal or abort of an object a pending lease waits for; False: not ours."""
        kind = note.get("notify")
        if kind == "reclaim":
            arena = self._by_arena.get(note.get("arena"))
            if arena is not None and isinstance(note.get("offset"), int):
                arena.reclaimed(note["offset"])
            return True
        if kind in ("sealed", "aborted") and "alloc" in note:
            self._keep_credits(note)
            if note["alloc"] in self._notes:
                self._notes[note["alloc"]] = note
            return True
        return False

    def on_reply(self, reply: dict) -> bool:
        """Keep the credits a reply brings; settle a pipelined create or seal. True: consumed."""
        self._keep_credits(reply)
        rid = reply.get("id")
        buf = self._inflight.pop(rid, None)
        if buf is not None:
            if reply.get("ok"):
                buf.alloc_id = reply.get("alloc", 0)
            else:
                self._refused(buf, error_from_wire(reply.get("code", 1), str(reply.get("error"))))
            return True
        buf = self._sealing.pop(rid, None)
        if buf is not None:
            if not reply.get("ok") and buf._carving.error is None:   # (after a refused create: expected)
                err = error_from_wire(reply.get("code", 1), str(reply.get("error")))
                log.error("the broker refused the seal of %r: %s", buf.name, err)
                self._client.async_errors.append(err)
            return True
        return False

    def _keep_credits(self, msg: dict) -> None:
        if "credit" in msg or "credits" in msg:
            got = [msg.get("credit")] if "credit" in msg else list(msg.get("credits") or ())
            if isinstance(msg.get("pool"), str):
                self._credits.setdefault(msg["pool"], collections.deque()).extend(
                    c for c in got if isinstance(c, bytes) and len(c) == HANDLE_BYTES)

    def _refused(self, buf: Buffer, err: IpcPoolError) -> None:
        cut = buf._carving
        cut.error = err
        if cut.slot is not None:
            cut.arena.free_slot(cut.slot)
            cut.slot = None
        if cut.sent:   # sealed or freed already: the range comes back here, the error later
            cut.arena.refused(cut.offset, cut.stream)
            self._deferred.append(err)
            self._client.async_errors.append(err)

    def raise_deferred(self) -> None:
        """Raise the first refusal of a request sent without waiting, if one came back."""
        if self._deferred:
            raise self._deferred.popleft()

    def flush(self) -> None:
        """Wait for the reply of every request sent without waiting; raise the first refusal."""
        c = self._client
        if self._inflight or self._sealing:
            c._wait_reply(-1, c.timeout, until=lambda: not (self._inflight or self._sealing))
        self.raise_deferred()

    # -- credits (CUDA: the broker's events a client records instead of exporting its own) -----------
    def take_credit(self, pool: str) -> bytes:
        credits = self._credits.get(pool)
        return credits.popleft() if credits else b""

    def release(self, buf: Buffer, stream: Any, credit: bytes | None = None) -> bytes:
        """Release ``buf``'s import; its done event, on a credit of the broker's where one is left."""
        own = credit is not None
        credit = credit if own else self.take_credit(buf.pool)
        done = self._client._pools[buf.pool].release(buf._memory, stream, credit)
        if credit and done != credit and not own:
            self._credits[buf.pool].appendleft(credit)   # not needed (memory with no done event): keep it
        return done

    # -- writer ------------------------------------------------------------------------------------
    def carve(self, op: str, fields: dict, *, name: str | None, owner: bool = True) -> Buffer | None:
        """A create or allocate carved here and sent without waiting; None where it cannot be."""
        nbytes, pool = fields["nbytes"], fields["pool"]
        if nbytes > self.arena_bytes // 4:
            return None
        self.raise_deferred()
        arena, offset = self._carve(pool, nbytes)
        if arena is None:
            return None
        c = self._client
        cut = Carving(arena, offset, 0)
        extra: dict[str, Any] = {}
        if name is not None and pool in self.boards:
            got = arena.slot()
            if got is not None:
                cut.promise = self.take_credit(pool) if c._pools[pool].seal_event else b""
                if cut.promise or not c._pools[pool].seal_event:
                    cut.slot, cut.seq = got
                    extra = {"slot": cut.slot, "seq": cut.seq}
                    if cut.promise:
                        extra["seal_credit"] = cut.promise
                else:
                    arena.free_slot(got[0])
        cut.rid = c._send(op, arena=arena.aid, offset=offset, **fields, **extra)
        buf = c._keep(0, pool, arena.memory_at(offset, nbytes), owner, name, fields.get("meta", {}), False)
        buf._carving = cut
        self._inflight[cut.rid] = buf
        return buf

    def _carve(self, pool: str, nbytes: int) -> tuple[ClientArena | None, int]:
        arenas = self._arenas.setdefault(pool, [])
        for attempt in range(2):
            for arena in reversed(arenas):
                offset = arena.carve(nbytes)
                if offset is not None:
                    return arena, offset
            if attempt == 0:
                self._client._drain()   # ranges the broker has reclaimed since
        if len(arenas) >= MAX_ARENAS or self._no_arena.get(pool, 0.0) > time.monotonic():
            return None, 0
        # Arenas grow as they are needed: the first holds four objects of this size (at least
        # 1 MiB), each next one twice the last, up to arena_bytes. A worker that hands off a few
        # small objects holds little more than their bytes.
        last = arenas[-1].memory.size if arenas else 0
        want = max(MIN_ARENA, 4 * nbytes, 2 * last)
        arena = self._open_arena(pool, min(self.arena_bytes, 1 << (want - 1).bit_length()))
        if arena is None:
            return None, 0
        arenas.append(arena)
        offset = arena.carve(nbytes)
        return (arena, offset) if offset is not None else (None, 0)

    def _open_arena(self, pool: str, nbytes: int) -> ClientArena | None:
        c = self._client
        try:
            reply = c._call("arena", pool=pool, nbytes=nbytes)
        except (InvalidRequest, ProtocolError) as exc:   # none from this pool (or broker): the usual way
            log.debug("no arena from pool %r: %s", pool, exc)
            self._no_arena[pool] = float("inf")
            return None
        except IpcPoolError as exc:   # out of memory or quota: the usual create says so plainly,
            log.debug("no arena from pool %r: %s", pool, exc)   # and we ask again only a second later
            self._no_arena[pool] = time.monotonic() + 1.0
            return None
        client_pool = c._pool(pool)
        words = reply.get("words")
        arena = ClientArena(reply["alloc"], client_pool, client_pool.import_allocation(export_of(reply)),
                            words if isinstance(words, int) and 0 <= words <= boards.WORDS - boards.BLOCK else None)
        self._by_arena[arena.aid] = arena
        return arena

    def seal(self, buf: Buffer, stream: Any) -> None:
        """Record, post the board word, send the seal: no wait (a refusal is raised later)."""
        c = self._client
        cut = buf._carving
        if cut is None:   # created with a round trip: the seal waits for its reply as well
            done = self.release(buf, stream)
            c._call("seal", name=buf.name, alloc=buf.alloc_id, **({"done_event": done} if done else {}))
            return
        cut.stream = stream
        if cut.error is not None:
            cut.arena.refused(cut.offset, stream)
            raise cut.error
        done = self.release(buf, stream, cut.promise or None)
        if cut.slot is not None:
            self.boards[buf.pool].post(cut.arena.words + cut.slot, cut.seq)   # after the record
            cut.arena.free_slot(cut.slot)   # numbers grow, so the word may serve the next object
            cut.slot = None
        cut.sent = True
        self._sealing[c._send("seal", name=buf.name, **({"done_event": done} if done else {}))] = buf

    def free(self, buf: Buffer, stream: Any) -> bool:
        """Free a carved buffer without waiting; False where ``buf`` was not carved here."""
        cut = buf._carving
        if cut is None:
            return False
        c = self._client
        cut.stream = stream
        # An object given up before its seal keeps its board word out of use: a reader may still
        # watch it for this object's number, which a later object's would pass.
        cut.slot = None
        if cut.error is not None:   # the broker never had it: only ours to drop
            cut.arena.refused(cut.offset, stream)
            return True
        done = self.release(buf, stream)
        cut.sent = True
        c._send("free", arena=cut.arena.aid, offset=cut.offset, **({"done_event": done} if done else {}))
        return True

    def settle(self, buf: Buffer) -> None:
        """Wait for the reply to ``buf``'s pipelined create (usually here already); raise its refusal."""
        cut = buf._carving
        if cut is not None:
            if cut.rid in self._inflight:
                self._client._wait_reply(-1, self._client.timeout, until=lambda: cut.rid not in self._inflight)
            if cut.error is not None:
                raise cut.error

    # -- reader ------------------------------------------------------------------------------------
    def await_seal(self, buf: Buffer, reply: dict, stream: Any, timeout: float | None) -> None:
        """A pending lease: wait until its object is sealed (the board word, else the broker's
        notice), then order ``stream`` after the seal. The lease is freed if that fails."""
        c = self._client
        aid, word, seq, event = reply["alloc"], reply.get("word"), reply.get("seq"), reply.get("event", b"")
        board = self.boards.get(buf.pool)
        if board is None or not isinstance(word, int) or not isinstance(seq, int) or not isinstance(event, bytes):
            buf.free(stream)
            raise ProtocolError("a pending lease without its board word")
        self._notes[aid] = None
        deadline = None if timeout is None else time.monotonic() + timeout
        spin_until = time.perf_counter() + self.get_spin_s
        try:
            spins = 0
            while board.read(word) < seq:
                note = self._notes[aid]
                if note is not None:
                    if note["notify"] == "aborted":
                        raise ObjectAborted(f"object {buf.name!r} was abandoned before it was sealed "
                                            "(its writer went away or deleted it)")
                    event = note.get("event", b"") if isinstance(note.get("event", b""), bytes) else b""
                    break
                if deadline is not None and time.monotonic() >= deadline:
                    raise WaitTimeout(f"object {buf.name!r} was not sealed within the timeout")
                spins += 1
                if time.perf_counter() < spin_until:
                    if spins % 32 == 0:
                        c._drain()
                else:   # sleep until something arrives (the notice comes with the seal)
                    left = 0.01 if deadline is None else max(0.0, min(0.01, deadline - time.monotonic()))
                    c._pump(left)
            c._pools[buf.pool].order_after(event, stream)
        except BaseException:
            buf.free(stream)
            raise
        finally:
            self._notes.pop(aid, None)


def export_of(reply: dict) -> Export:
    """An allocation's export as a reply carries it."""
    return Export(size=reply["size"], offset=reply["offset"], data=reply["data"],
                  ready_event=reply["event"], sub=bool(reply.get("sub")),
                  chunks=tuple(reply.get("chunks") or ()))
