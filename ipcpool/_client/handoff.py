"""A client's side of a hand-off: carve, seal, wait, board. No step of a writer waits for the broker.

- **Carve.** Objects (and anonymous allocations) of up to a quarter of ``arena_bytes`` are carved
  here from pool memory this client holds (arenas of 1 MiB first, doubling up to ``arena_bytes``), so ``create``/``allocate`` send their request without
  waiting; the broker mirrors and checks every range (``broker/arenas.py``) and says when a range
  is idle again (``reclaim``). ``ClientArena`` is one arena, ``Carving`` one range carved from
  it. A refusal arrives later: it is kept, the range comes back once the
  work queued on it has finished, and the error is raised by the client's next ``create``,
  ``allocate``, ``seal`` or ``flush``.
- **Seal.** A carved object has a word on its pool's seal board and, on CUDA, an event of the
  broker's (a credit) it promised in its create to record its seal on. ``seal`` records, posts
  the word, and sends the seal without waiting.
- **Read.** A reader looks for its object in its pool's name directory and takes its lease there
  (``look``); one that waits past its spin budget sleeps until the broker wakes it (``_send_wake``).
- **Wait.** A reader whose ``get`` the broker answered *pending* (it already has the object's
  memory and the promised event) spins on the board word, then sleeps until the broker's notice,
  and orders its work after the event by querying it on the host (``ClientPool.order_after``).

The buffers here are ``leases.Buffer``s, made by the lease table's ``keep``; the hand-off owns
their ``carving`` record and reads only their public fields besides.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from .. import frames, protocol
from .. import trace
from ..backend.base import ClientPool, ImportedMemory
from ..errors import InvalidRequest, IpcPoolError, ObjectAborted, OutOfMemory, ProtocolError, WaitTimeout
from ..protocol import ARENA_ALIGN, MAX_ARENAS
from ..ranges import RangeAllocator
from ..replies import AbortNotice, Allocation, Arena, Carved, Lease, ReclaimNotice, SealNotice, credits_of
from ..shm import directory, fence, futex, leases, requests, sealboard
from ..sizes import HANDLE_BYTES
from .channel import Channel
from .interop import Views
from .pools import Pools
from .waitlog import SlowWait, describe

log = logging.getLogger(__name__)

MIN_ARENA = 1 << 20
# A steady writer's carves made ready at once, at most (and at most a quarter of an arena's bytes):
# made in one go, on caches warm from the first, one seal in this many pays for them (``_prepare``).
READY_AHEAD = 4
LOW_SLOTS = 16   # a reader's free lease slots below which its release takes in the answers waiting
FREEING_MAX = 1024   # names given up whose free may be unhandled, at most (``Handoff._freeing``)
# A reader told the object exists that finds no entry looks again while the directory changes,
# this long at most, before it asks the broker: an entry (or one before it on its probe) the
# broker is rewriting when a busy machine takes its CPU away reads as none (``TORN_US``).
ANSWERED_LOOK_S = 0.005
_NO_CREDIT = bytes(HANDLE_BYTES)
_NO_ARENAS: dict = {}   # (a pool none of whose arenas is imported here)
_DROP = object()       # a wake's answer nobody waits for any more
_MISSING = object()    # no directory has the name (``Handoff._found``)
_NOT_SEEN = object()   # no stream sealed on yet (``Handoff._stream_seen``)

try:   # a steady writer's name checked in one C call (``protocol.NAME_RE``'s rule: a test holds the two together)
    from ..shm._native import valid_name as _valid_name
except ImportError:
    _valid_name = protocol.valid_object_name


# -- carving: an arena is an allocation of this client's, imported once; its free ranges are kept here
# (the broker mirrors them) with its block of words on the pool's seal board ----------------------
class ClientArena:
    """Pool memory this client carves from, and its block of the pool's seal board."""

    def __init__(self, aid: int, pool: ClientPool, memory: ImportedMemory, words: int | None, first_seq: int = 1):
        self.aid = aid
        self.pool = pool
        self.memory = memory
        self.ranges = RangeAllocator(memory.size, ARENA_ALIGN)   # the broker rounds alike
        self.words = words   # the first word of its board block, or None (no block left)
        # Its free board words, the one freed longest ago first: a word is used again as late as
        # may be, so a reader that looks late still finds its object's number there.
        self.slots = collections.deque(range(sealboard.BLOCK)) if words is not None else collections.deque()
        self._seq = first_seq - 1   # (numbers start where the broker says: ``sealboard.Blocks``)
        self._cooling: list[tuple[int, Any]] = []   # refused ranges, until their work finished
        # Reclaimed ranges kept taken, by rounded size: a writer handing off objects of one size
        # carves each from a range reclaimed before (a pop, where the allocator's best fit costs
        # ~8 µs a carve on an H100 host), the longest reclaimed first: it keeps to a few ranges
        # however late a reclaim arrives, where its readers' leases are made ahead (``NextLease``).
        # Given back to the allocator when it runs out of room.
        self._spare: dict[int, collections.deque[int]] = {}

    def carve(self, nbytes: int) -> int | None:
        """An offset for ``nbytes``, or None when the arena has no room."""
        if self._cooling:
            self._cool()
        spare = self._spare.get(self.ranges.rounded(nbytes))
        if spare:
            return spare.popleft()
        try:
            return self.ranges.allocate(nbytes)
        except OutOfMemory:
            if not any(self._spare.values()):
                return None
        for offsets in self._spare.values():   # room for another size: the spares go back
            for offset in offsets:
                self.ranges.free(offset)
        self._spare.clear()
        try:
            return self.ranges.allocate(nbytes)
        except OutOfMemory:
            return None

    def holds(self, offset: int) -> bool:
        """Whether the range at ``offset`` is carved out (neither free nor a spare)."""
        return self.ranges.taken(offset) and offset not in self._spare.get(self.ranges.size_of(offset), ())

    def slot(self) -> tuple[int, int] | None:
        """A free board word of this arena and the next number (numbers only grow); given back
        by ``slots.append`` (a method of the deque's, where one of ours is a call more on a seal)."""
        if not self.slots:
            return None
        self._seq += 1
        return self.slots.popleft(), self._seq

    def reclaimed(self, offset: int) -> None:
        """The broker says the range at ``offset`` is idle: every importer is done with it."""
        if self.ranges.taken(offset):   # (a stale notice of a refused range: never taken)
            self._spare.setdefault(self.ranges.size_of(offset), collections.deque()).append(offset)

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
    framed: bool = False        # its create went as a frame on the control socket (``ipcpool.frames``)
    ring: Any = None            # ... or in the session's request ring, where there is one (``Handoff._ring``)
    memory: ImportedMemory | None = None   # the range, imported: what its buffer holds
    ready_frames: tuple[bytes, bytes] | None = None   # made ready (``_prepare``): its create and seal frames, nameless
    # ... and what its seal records on, the board's map, its word there, and what to call once
    # sealed (``ClientPool.seal_target``): the seal then in one C call (``requests.put_sealed``)
    sealer: tuple[Any, Any, int, Callable[[], Any] | None] | None = None


class NextLease:
    """A directory reader's next leases, made ahead: as it releases a lease, else while it waits
    for the next object's entry (the buffer, its range's import and its tensor: ~20 µs on an H100
    host that would otherwise follow the entry, as the writer's next carve is made at its seal).
    One is made for each range the reader has read twice, up to ``MADE_MOST`` a pool, the one read
    least lately given up first: a writer that hands off one size of object carves them from a few
    ranges, so its reader's next object lies where a lease is made, in whatever order late
    reclaims give the ranges back. A reader of objects that seldom share a range makes seldom; a
    lease made and not used costs only time off the hand-off's path."""

    MADE_MOST = 16   # leases made ahead, a pool
    MAX_SEEN = 256   # ranges counted; past them, forgotten and counted again
    UNLEARNT = 64    # ranges taken and not counted yet (a reader that holds many leases): counted then

    def __init__(self) -> None:
        self._seen: dict[tuple, int] = {}      # where an object lay -> times read (1 or 2)
        self._taken: list[tuple] = []          # where the objects taken since lay, counted at ``make``
        # By pool, ``directory.where_key`` -> (where, the arena's import, the buffer): a reader's take
        # in C looks its entry up there and takes it out (``Handoff._found``), then ``hit``.
        self.made: dict[str, dict[bytes, tuple]] = {}

    def make(self, arena_of: Callable[[str, int], Any], lease_at: Callable[[tuple, Any], Any]) -> None:
        """A buffer (``lease_at(where, arena)``) for each range taken since that was read twice
        and has none made, where its arena is imported here (``arena_of(pool, arena id)``). What
        was taken since is counted here, off the hand-off's path."""
        taken, self._taken = self._taken, []
        for at in taken:
            if self._count(at) < 2:
                continue
            made, key = self.made.setdefault(at[0], {}), directory.where_key(*at[1:])
            if key in made:
                continue
            arena = arena_of(at[0], at[1])
            if arena is None:
                continue
            if len(made) >= self.MADE_MOST:
                del made[next(iter(made))]   # (the first made of those left: read least lately)
            made[key] = (at, arena, lease_at(at, arena))

    def forget(self) -> None:
        """Drop what was made (at close: its tensor views the pool's memory)."""
        self.made.clear()

    def hit(self, name: str, made: tuple, lease: tuple, entered: dict[int, Any]) -> Any:
        """``made``, the (where, arena, buffer) the C take took out of ``made`` for sealed object
        ``name``, whose seal is done: its buffer, now the lease with hazard slot ``lease``
        (``Handoff._found``), entered in ``entered``; counted as ``take`` counts."""
        self._taken_at(made[0])
        buf = made[2]
        buf.name = name
        entered[id(buf)] = buf
        buf.dirlease = lease
        # (found, seen sealed and ordered after in that one call: three moments as one)
        if trace.hook is not None:
            trace.emit("client.entry_found", name=name)
        if trace.hook is not None:
            trace.emit("client.seal_seen", name=name)
        if trace.hook is not None:
            trace.emit("client.ordered", name=name)
        return buf

    def take(self, at: tuple, arena: ImportedMemory) -> Any:
        """The buffer made for ``at`` in ``arena``, taken out, else None; ``at`` is counted at the
        next ``make`` (this runs on the hand-off's path)."""
        self._taken_at(at)
        made = self.made.get(at[0])
        got = made.pop(directory.where_key(*at[1:]), None) if made else None
        if got is None or got[1] is not arena:   # (an arena imported again: not its range)
            return None
        return got[2]

    def _taken_at(self, at: tuple) -> None:
        taken = self._taken
        taken.append(at)
        if len(taken) >= self.UNLEARNT:   # (counted without making: a get's path)
            for where in taken:
                self._count(where)
            taken.clear()

    def _count(self, at: tuple) -> int:
        """``at`` read once more: how often it was (counted up to 2)."""
        n = self._seen.get(at, 0)
        if n < 2:
            if not n and len(self._seen) >= self.MAX_SEEN:
                self._seen.clear()
            n = self._seen[at] = n + 1
        return n


class Handoff:
    def __init__(self, channel: Channel, pools: Pools, arena_bytes: int, keep: Callable[..., Any],
                 entered: dict[int, Any], views: Views):
        """``keep(alloc_id, pool, memory, owner, name, meta, readonly, enter=True)`` makes a buffer
        and enters it in the lease table, ``entered`` (by id; ``enter=False``: here, later);
        ``views`` makes their tensors."""
        self._channel = channel
        self._entered = entered
        self._views = views
        self._ahead: collections.deque = collections.deque()   # the next carves, made ready (``_prepare``)
        self._last: tuple[str, int] | None = None   # (pool, nbytes) of the last carved create
        self._steady = False                        # ... and the one before it was the same
        self._pools = pools
        self._imported = pools.imported
        self._keep = keep
        self.arena_bytes = arena_bytes
        self.boards: dict[str, sealboard.Board] = pools.boards
        self._arenas: dict[str, list[ClientArena]] = {}   # per pool
        self._no_arena: dict[str, float] = {}             # pool -> when to ask for an arena again
        self._by_arena: dict[int, ClientArena] = {}
        self._inflight: dict[int, Any] = {}   # pipelined creates/allocates by request id
        self._sealing: dict[int, Any] = {}    # pipelined seals by request id
        # Names given up (``free``) by a message not answered yet: a create of one goes as a
        # message too, after it (a frame could overtake it: "already exists"). Name -> its id.
        self._freeing: dict[str, int] = {}
        # Frees sent before their create was answered, by id: where the create is refused, the
        # free's own refusal (the broker never carved that range) says nothing new.
        self._early_frees: dict[int, Any] = {}
        self._credits: dict[str, collections.deque[bytes]] = {}   # the broker's events, per pool
        self._notes: dict[int, SealNotice | AbortNotice | None] = {}   # pending leases watched: alloc -> its notice
        self._arena_views: dict[str, dict[int, ImportedMemory]] = {}   # pool -> arena -> its import
        self._releasing: dict[int, int] = {}   # directory leases' releases by request id -> slot
        self._next = NextLease()   # a directory reader's next leases, made ahead
        self._stream_seen: tuple[Any, int] = (_NOT_SEEN, 0)   # the last stream sealed on, as an int
        self._wakes: dict[int, Any] = {}   # gets that only wake a reader, by id: None, their answer, or _DROP
        self._slow: SlowWait | None = None   # the get under way, waiting without a deadline (``_send_wake``)
        self.wakes_sent = 0   # gets that waited past the spin budget (``bench/handoff.py`` counts them)
        self._cutting = False   # a carve under way (a call it makes does no carve of its own meanwhile)
        self._room = True       # the last carve made in a wait found room (tried again after a seal)
        channel.idle = self.ready_more

    # -- what arrives from the broker --------------------------------------------------------------
    def on_notice(self, note: dict) -> bool:
        """A reclaim, or the seal or abort of an object a pending lease waits for; False: not ours."""
        kind = note.get("notify")
        if kind == "reclaim":
            got = ReclaimNotice.decode(note)
            arena = self._by_arena.get(got.arena)
            if arena is not None and isinstance(got.offset, int):
                arena.reclaimed(got.offset)
            return True
        if kind in ("sealed", "aborted") and "alloc" in note:
            self._keep_credits(note)
            if note["alloc"] in self._notes:
                self._notes[note["alloc"]] = SealNotice.decode(note) if kind == "sealed" else AbortNotice.decode(note)
            return True
        return False

    def on_reply(self, reply: dict) -> bool:
        """Keep the credits a reply brings; settle a pipelined create or seal, or a directory
        lease's release. True: consumed."""
        self._keep_credits(reply)
        rid = reply.get("id")
        if rid in self._wakes:   # a get that only wakes a reader: kept for it, or dropped
            if self._wakes[rid] is _DROP:
                del self._wakes[rid]
            else:
                self._wakes[rid] = reply
            return True
        slot = self._releasing.pop(rid, None)
        if slot is not None:
            if not reply.get("ok"):
                log.error("the broker refused a lease's release: %s", reply.get("error"))
            self._pools.lease_page.give_back(slot)
            return True
        buf = self._inflight.pop(rid, None)
        if buf is not None:
            if reply.get("ok"):
                buf.alloc_id = Carved.decode(reply).alloc
                if self._early_frees:   # (its free, if it was early, is the broker's to answer)
                    self._early_frees = {r: b for r, b in self._early_frees.items() if b is not buf}
            else:
                op = "allocate" if buf.name is None else "create"
                self._refused(buf, _naming(protocol.refusal(reply), op, buf.name))
            return True
        for pending, op in ((self._sealing, "seal"), (self._early_frees, "free")):
            buf = pending.pop(rid, None)
            if buf is not None:
                if not reply.get("ok") and buf.carving.error is None:   # (after a refused create: expected)
                    self._channel.refused(_naming(protocol.refusal(reply), op, buf.name))
                return True
        return False

    def _keep_credits(self, msg: dict) -> None:
        got = credits_of(msg)
        if got is not None:
            self._credits.setdefault(got[0], collections.deque()).extend(
                c for c in got[1] if isinstance(c, bytes) and len(c) == HANDLE_BYTES)

    def _refused(self, buf: Any, err: IpcPoolError) -> None:
        self.unprepare()   # (a writer whose create failed starts afresh: the arena as it was)
        cut = buf.carving
        cut.error = err
        if cut.slot is not None:
            cut.arena.slots.append(cut.slot)
            cut.slot = None
        if cut.sent:   # sealed or freed already: the range comes back here, the error later
            cut.arena.refused(cut.offset, cut.stream)
        self._channel.refused(err, unraised=cut.sent)   # else its seal (or free) raises it

    def raise_deferred(self) -> None:
        """Raise the first refusal of a request sent without waiting, if one came back."""
        self._channel.raise_unraised()

    def settle_all(self) -> None:
        """Wait for the reply of every request sent without waiting (refusals are kept, not
        raised): creates, seals, and the frees that gave up an object (after them the name is free
        again, and another session sees it gone)."""
        ch = self._channel
        if self._inflight or self._sealing:
            ch.wait_reply(-1, ch.timeout, until=lambda: not (self._inflight or self._sealing))
        if self._freeing and not ch.answered(max(self._freeing.values())):
            ch.settle()   # (a free is answered only where refused: a ping after it says it was read)

    def flush(self) -> None:
        """Wait for the reply of every request sent without waiting; raise the first refusal."""
        self.settle_all()
        self.raise_deferred()

    # -- credits (CUDA: the broker's events a client records instead of exporting its own) -----------
    def take_credit(self, pool: str) -> bytes:
        credits = self._credits.get(pool)
        return credits.popleft() if credits else b""

    @trace.phase("release")
    def release(self, pool: str, memory: ImportedMemory, stream: Any, credit: bytes | None = None, *,
                if_busy: bool = False) -> bytes:
        """Release an import of ``pool``; its done event, on a credit of the broker's where one is
        left (``if_busy``: none where the work on ``stream`` is done, ``ClientPool.release``)."""
        own = credit is not None
        credit = credit if own else self.take_credit(pool)
        done = self._imported[pool].release(memory, stream, credit, if_busy=if_busy)
        if credit and done != credit and not own:
            self._credits[pool].appendleft(credit)   # not needed (memory with no done event): keep it
        return done

    def imported(self, pool: str) -> Any:
        """Pool ``pool`` as imported here (a ``ClientPool``), or None."""
        return self._imported.get(pool)

    @trace.phase("keep")
    def keep(self, pool: str, memory: ImportedMemory, stream: Any) -> tuple[bytes, Any] | None:
        """As ``release``, but the import stays (``ClientPool.keep``): ``(done event, token)``, or
        None where the pool keeps nothing of this memory (the caller releases it)."""
        credit = self.take_credit(pool)
        got = self._imported[pool].keep(memory, stream, credit)
        if credit and (got is None or got[0] != credit):
            self._credits[pool].appendleft(credit)   # not recorded: kept for the next
        return got

    # -- writer ------------------------------------------------------------------------------------
    def carve(self, op: str, fields: dict, *, name: str | None, owner: bool = True) -> Any:
        """A create or allocate carved here and sent without waiting (a buffer); None where it
        cannot be."""
        nbytes, pool = fields["nbytes"], fields["pool"]
        if nbytes > self.arena_bytes // 4:
            return None
        self.raise_deferred()
        meta = fields.get("meta")
        buf = self._ahead_for(pool, nbytes, name)
        if buf is None:
            cut = self._cut(pool, nbytes, name is not None)
            if cut is None:
                return None
            buf = self._keep(0, pool, cut.memory, owner, name, meta, False, enter=False)
            buf.carving = cut
        else:   # made ready after the last seal: only its name and request are new
            buf.name, buf.owner, buf.meta = name, owner, meta or {}
            if meta:
                buf.tensor_ahead = None   # (made as bytes: its dtype and shape are the usual call's)
        self._send(buf, op, name, meta, fields)
        if name is not None:
            self._steady = self._last == (pool, nbytes)
            self._last = (pool, nbytes)
        return buf

    def create_ready(self, name: str, nbytes: int, pool: str, writing: set[str]) -> Any:
        """The usual hand-off's create: the buffer made ready at the writer's last seal
        (``_prepare``) named ``name`` and its frame sent first (the broker's directory entry, which
        a reader spins on, waits for it), after every check in one condition. None where anything
        is not as usual (no such buffer, a refusal to raise, a name in use here or invalid, a
        closed client): ``carve`` then does it, or says why not. Each line before the frame runs
        on a worker that often comes back from sleep with cold caches."""
        ahead, ch = self._ahead, self._channel
        if not ahead:
            return None
        buf = ahead[0]
        if (buf.pool != pool or type(nbytes) is not int or buf.memory.size != nbytes
                or buf.carving.ready_frames is None or ch.closed or ch.unraised or type(name) is not str or name in writing
                or not _valid_name(name) or (self._freeing and self._still_freeing(name))):
            return None
        ahead.popleft()
        buf.name = name
        cut = buf.carving
        try:   # its frame and its seal's built ahead (``_prepare``): the id and name added, in C
            cut.rid = ch.send_ready(cut.ready_frames[0], frames.CREATE_NAME_LEN_AT, name, cut.ring)
        except BaseException:   # not sent (the broker gone, say): the range is ours alone to take back
            self.unprepare(buf)
            raise
        # In flight, as ``_send`` keeps it (here, not by a call to it: a call less on this path).
        if trace.hook is not None:
            trace.emit("client.create_sent", op="create", name=name, rid=cut.rid, framed=True)
        self._entered[id(buf)] = buf
        self._inflight[cut.rid] = buf
        writing.add(name)
        return buf   # (still steady: made ready only for this pool and size)

    def _send(self, buf: Any, op: str, name: str | None, meta: dict | None, fields: dict) -> None:
        """A carved buffer's create (or allocate) of ``fields`` sent without waiting, then awaited
        as in flight: a named one without long metadata as a frame (its seal follows on the same
        socket), else as a message."""
        cut = buf.carving
        try:
            cut.ready_frames = cut.sealer = None   # (its seal goes the way this create goes)
            packed = protocol.pack(meta) if meta else b""
            cut.framed = (name is not None and len(packed) <= frames.MAX_META
                          and not (self._freeing and self._still_freeing(name)))
            if cut.framed:
                cut.ring = self._ring(buf.pool)   # (its seal's too)
                cut.rid = self._channel.send_frame(frames.create, buf.pool.encode(), name.encode(), packed,
                                                   cut.arena.aid, cut.offset, buf.memory.size, cut.slot,
                                                   cut.seq, cut.promise or _NO_CREDIT, ring=cut.ring)
            else:
                extra: dict[str, Any] = {} if cut.slot is None else {"slot": cut.slot, "seq": cut.seq}
                if cut.promise:
                    extra["seal_credit"] = cut.promise
                cut.rid = self._channel.send(op, arena=cut.arena.aid, offset=cut.offset, **fields, **extra)
        except BaseException:   # not sent (too large, say): the range is ours alone to take back
            self.unprepare(buf)
            raise
        if trace.hook is not None:
            trace.emit("client.create_sent", op=op, name=name, rid=cut.rid, framed=cut.framed)
        self._entered[id(buf)] = buf
        self._inflight[cut.rid] = buf

    def _ring(self, pool: str) -> requests.Route | None:
        """This session's request ring and ``pool``'s directory, which says how long the broker
        reads the ring (``shm.requests``); None where there is none."""
        pools = self._pools
        if pools.unmapped:
            pools.map_directories()
        page, got = pools.lease_page, pools.directories.get(pool)
        return None if page is None or got is None else requests.Route.of(page.ring, got[0])

    def _cut(self, pool: str, nbytes: int, named: bool, grow: bool = True) -> Carving | None:
        """A range of an arena of ``pool`` for ``nbytes``, imported, with a board word and the
        credit its seal will be recorded on where it is ``named``; None where none can be had
        (``grow=False``: where no arena this client holds has room now)."""
        self._cutting = True
        try:
            arena, offset = self._carve(pool, nbytes) if grow else self._carve_held(pool, nbytes)
        finally:
            self._cutting = False
        if arena is None:
            return None
        cut = Carving(arena, offset, 0)
        if named and pool in self.boards:
            got = arena.slot()
            if got is not None:
                seal_event = self._imported[pool].seal_event
                cut.promise = self.take_credit(pool) if seal_event else b""
                if cut.promise or not seal_event:
                    cut.slot, cut.seq = got
                else:
                    arena.slots.append(got[0])
        cut.memory = arena.pool.carved(arena.memory, offset, nbytes)
        return cut

    # A writer that hands off objects of one size has its next ones made ready as it seals the last
    # of those made before (range, board word, credit, buffer, and the tensor view where it asked
    # for one): off the hand-off's path, as the floor sets up its memory once. Made a few at a time,
    # the first warms the caches for the rest (on an H100 host, after a 200 µs nap, one alone cost a
    # seal 37.5 µs and four 94), and only one seal in that many pays. Another size, or close, gives
    # them back. (Made on a thread of the client's own instead, the writer's calls took ~20 µs less and
    # the hand-off as a whole 10-20 µs more: that work then ran beside the reader's. docs/design.md.)
    def _prepare(self, pool: str, nbytes: int) -> None:
        """(``seal`` calls it once none is left and the writer is steady.)"""
        if self._last != (pool, nbytes):
            return
        for _ in range(self._ready_most(nbytes)):
            buf = self._made_ready(pool, nbytes)
            if buf is None:
                return
            self._ahead.append(buf)

    def _ready_most(self, nbytes: int) -> int:
        return max(1, min(READY_AHEAD, self.arena_bytes // 4 // nbytes))

    # A writer that also makes a call that waits (a delete, a get, a flush) has one carve more made
    # ready in that wait, while the broker works on its request: a carve costs about what the round
    # trip does (~25 µs on an H100 host), and a seal then seldom finds none left to make four of
    # (~95 µs there, one seal in four). Only from an arena that has room: no call of its own.
    def ready_more(self) -> None:
        """(``Channel.call`` calls it once its request is sent.)"""
        last = self._last
        if (not self._steady or last is None or self._cutting or not self._room or not self._ahead
                or len(self._ahead) >= self._ready_most(last[1])):
            return   # (none made ready yet: the writer's next seal makes them, as it would)
        try:
            buf = self._made_ready(*last, grow=False)
        except Exception:   # (a call's wait is no place to fail it: the next seal makes them instead)
            log.warning("a carve made ready while waiting failed; carves are made at seals only from now on",
                        exc_info=True)
            self._channel.idle = None
            return
        if buf is None:   # (no room, or no board word: not tried again in every call until a seal)
            self._room = False
        else:
            self._ahead.append(buf)

    def _made_ready(self, pool: str, nbytes: int, grow: bool = True) -> Any:
        """One carve made ready for the next create of ``nbytes`` in ``pool``, else None (past
        the first, one that would go without a board word is not made; ``grow``: as ``_cut``)."""
        try:
            cut = self._cut(pool, nbytes, True, grow)
        except IpcPoolError as exc:   # (an arena the broker refuses now: the next create says so)
            log.debug("no carve made ready in pool %r: %s", pool, exc)
            return None
        if cut is None:
            return None
        if cut.slot is None and self._ahead and pool in self.boards:   # (no word or credit left)
            self._give_back(pool, cut)
            return None
        buf = self._keep(0, pool, cut.memory, True, None, None, False, enter=False)
        buf.carving = cut
        if cut.slot is not None:   # the usual hand-off's two frames, all but the id and name
            cut.ring, cut.framed = self._ring(pool), True
            credit = cut.promise or _NO_CREDIT
            cut.ready_frames = (frames.create(0, pool.encode(), b"", b"", cut.arena.aid, cut.offset, nbytes, cut.slot,
                                        cut.seq, credit), frames.seal(0, b"", credit))
            board = self.boards.get(pool)
            try:
                target = None if board is None else self._imported[pool].seal_target(cut.memory, cut.promise)
            except IpcPoolError as exc:   # (the credit not opened: the seal goes the general way)
                log.debug("no one-call seal made ready in pool %r: %s", pool, exc)
                target = None
            if target is not None:
                cut.sealer = (target[0], board.mapping, cut.arena.words + cut.slot, target[1])
        if self._views.asked:
            buf.tensor_ahead = self._views.ahead(buf, cut.memory)
        return buf

    def _ahead_for(self, pool: str, nbytes: int, name: str | None) -> Any:
        """The buffer made ready for this create, else None (where the next does not fit, all
        those made ready go back)."""
        ahead = self._ahead
        if not ahead:
            return None
        buf = ahead[0]
        if name is not None and buf.pool == pool and buf.memory.size == nbytes:
            return ahead.popleft()
        self.unprepare()
        return None

    def unprepare(self, buf: Any = None) -> None:
        """Give back the carves made ready, or ``buf`` (one whose create was never sent): each
        one's range, board word and credit. Without ``buf``, a reader's next lease made ahead
        goes too (at close: its tensor views the pool's memory)."""
        if buf is not None:
            self._give_back(buf.pool, buf.carving)
            return
        self._next.forget()
        while self._ahead:   # (the last made first: the credits go back in the order they came)
            buf = self._ahead.pop()
            self._give_back(buf.pool, buf.carving)

    def _give_back(self, pool: str, cut: Carving) -> None:
        cut.arena.ranges.free(cut.offset)   # (never announced: the broker has nothing to undo)
        if cut.slot is not None:
            cut.arena.slots.append(cut.slot)
        if cut.promise:
            self._credits[pool].appendleft(cut.promise)

    def _carve_held(self, pool: str, nbytes: int) -> tuple[ClientArena | None, int]:
        for arena in reversed(self._arenas.get(pool, ())):
            offset = arena.carve(nbytes)
            if offset is not None:
                return arena, offset
        return None, 0

    def _carve(self, pool: str, nbytes: int) -> tuple[ClientArena | None, int]:
        arenas = self._arenas.setdefault(pool, [])
        for attempt in range(2):
            arena, offset = self._carve_held(pool, nbytes)
            if arena is not None:
                return arena, offset
            if attempt == 0:
                self._channel.drain()   # ranges the broker has reclaimed since
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
        try:
            reply = self._channel.call("arena", pool=pool, nbytes=nbytes)
        except (InvalidRequest, ProtocolError) as exc:   # none from this pool (or broker): the usual way
            log.debug("no arena from pool %r: %s", pool, exc)
            self._no_arena[pool] = float("inf")
            return None
        except IpcPoolError as exc:   # out of memory or quota: the usual create says so plainly,
            log.debug("no arena from pool %r: %s", pool, exc)   # and we ask again only a second later
            self._no_arena[pool] = time.monotonic() + 1.0
            return None
        got = Arena.decode(reply)   # (its credits were kept as it arrived: ``on_reply``)
        client_pool = self._pools.get(pool)
        words, first = got.words, got.first_seq
        memory = self._pools.import_allocation(got.alloc, pool, got.export)   # (a VMM slab's FD too)
        if not (isinstance(words, int) and 0 <= words <= sealboard.WORDS - sealboard.BLOCK
                and isinstance(first, int) and 1 <= first < sealboard.FIRST_MAX):
            words = None   # (its objects go without a board word)
        arena = ClientArena(got.alloc, client_pool, memory, words, first if words is not None else 1)
        self._by_arena[arena.aid] = arena
        return arena

    def seal(self, buf: Any, stream: Any) -> None:
        """Seal a carved buffer: record, post the board word, send the seal. No wait (a refusal
        is raised later)."""
        cut = buf.carving
        cut.stream = stream
        self._room = True
        # A refusal this client has taken in already is raised here; draining the channel to look
        # for one would cost the hand-off ~30 µs (H100), and close() or flush() raises a later one.
        if cut.error is not None:
            cut.arena.refused(cut.offset, stream)
            raise cut.error
        name, sealer, rid = buf.name, cut.sealer, None
        if sealer is not None and sealer[0].handle is not None:   # the usual seal (made ready): one C call
            on = self._stream_seen
            if stream is not on[0]:
                on = self._stream_seen = (stream, self._imported[buf.pool].stream_int(stream))
            rid = self._channel.send_ready(cut.ready_frames[1], frames.SEAL_NAME_LEN_AT, name, cut.ring,
                                           (sealer[0].ptr, on[1], sealer[1], sealer[2], cut.seq))
            if rid is not None:
                if sealer[3] is not None:
                    sealer[3]()   # (the memory is the pool's now)
                # (posted in that call, before its frame)
                if trace.hook is not None:
                    trace.emit("client.seal_posted", name=name)
        if rid is None:
            rid = self._seal_apart(buf, cut, stream, name)
        if cut.slot is not None:   # the word may serve the next object (with its own number)
            cut.arena.slots.append(cut.slot)
            cut.slot = None
        cut.sent = True
        if trace.hook is not None:
            trace.emit("client.seal_sent", name=name, rid=rid, framed=cut.framed)
        self._sealing[rid] = buf
        if not self._ahead and self._steady:   # (three seals in four: made ready already, no call)
            self._prepare(buf.pool, buf.memory.size)

    def _seal_apart(self, buf: Any, cut: Carving, stream: Any, name: str) -> int:
        """``seal``'s record (or release), board post and frame, each its own call: where the one
        C call cannot serve (no C part, no ring in use, a stream of another device, a create
        sent the general way). The seal's request id."""
        posted = False
        if cut.promise:   # the credit it promised (the usual hand-off): recorded by the pool, one call
            pool = self._imported[buf.pool]
            if cut.slot is not None:   # ... with its board word posted after, in the same call
                posted = pool.seal_range(cut.memory, stream, cut.promise, self.boards[buf.pool],
                                         cut.arena.words + cut.slot, cut.seq)
            done = cut.promise if posted else pool.release(cut.memory, stream, cut.promise)
        else:
            done = self.release(buf.pool, cut.memory, stream)
        if cut.slot is not None and not posted:
            self.boards[buf.pool].post(cut.arena.words + cut.slot, cut.seq)   # after the record
        if trace.hook is not None:
            trace.emit("client.seal_posted", name=name)
        if cut.ready_frames is not None and done == cut.promise:   # as built ahead
            return self._channel.send_ready(cut.ready_frames[1], frames.SEAL_NAME_LEN_AT, name, cut.ring)
        if cut.framed:
            return self._channel.send_frame(frames.seal, name.encode(), done or _NO_CREDIT, ring=cut.ring)
        # After a create on the message channel: there too, so it cannot overtake it.
        return self._channel.send("seal", name=name, **({"done_event": done} if done else {}))

    def free(self, buf: Any, stream: Any, abandoned: str | None) -> bool:
        """Free a carved buffer without waiting (``abandoned``: the name of the object it was
        created for, never sealed); False where ``buf`` was not carved here."""
        cut = buf.carving
        if cut is None:
            return False
        cut.stream = stream
        # Its board word serves the next object: a reader still watching it for this object's
        # number, and the broker, take only that very number for this object's seal.
        if cut.slot is not None:
            cut.arena.slots.append(cut.slot)
            cut.slot = None
        if cut.error is not None:   # the broker never had it: only ours to drop
            cut.arena.refused(cut.offset, stream)
            return True
        done = self.release(buf.pool, cut.memory, stream, if_busy=True)
        cut.sent = True
        rid = self.send_free(abandoned, arena=cut.arena.aid, offset=cut.offset, **({"done_event": done} if done else {}))
        if cut.rid in self._inflight:   # its create unanswered yet (``_early_frees``)
            self._early_frees[rid] = buf
        return True

    def send_free(self, abandoned: str | None, **fields) -> int:
        """A free sent without waiting, its id; one that gives up ``abandoned`` (an object never
        sealed) names it, and a create of that name goes after it (``_freeing``)."""
        if abandoned is None:
            return self._channel.send("free", **fields)
        if len(self._freeing) >= FREEING_MAX:   # (bounded: a round trip, and every one is handled)
            self._channel.settle()
            self._freeing.clear()
        rid = self._freeing[abandoned] = self._channel.send("free", name=abandoned, **fields)
        return rid

    def _still_freeing(self, name: str) -> bool:
        """Whether ``name``'s free (``_freeing``) is unanswered; the answered are dropped."""
        rid = self._freeing.get(name)
        if rid is None:
            return False
        if not self._channel.answered(rid):
            return True
        self._freeing = {n: r for n, r in self._freeing.items() if not self._channel.answered(r)}
        return False

    def settle(self, buf: Any) -> None:
        """Wait for the reply to ``buf``'s pipelined create (usually here already); raise its refusal."""
        cut = buf.carving
        if cut is not None:
            if cut.rid in self._inflight:
                ch = self._channel
                ch.wait_reply(-1, ch.timeout, until=lambda: cut.rid not in self._inflight)
            if cut.error is not None:
                raise cut.error

    # -- reader: straight from a name directory (``ipcpool.shm``) -------------------------------------
    def look(self, name: str, stream: Any, timeout: float | None) -> Any:
        """A read lease on ``name`` taken from a directory of the pools this client has, without a
        request; None where the broker must answer instead (no entry even once woken, an object
        the directory cannot serve, every lease slot in use). A reader whose spin budget runs out
        before the entry comes asks the broker to wake it once the object exists, spins once more
        meanwhile, then sleeps until the answer (``_send_wake``): one request."""
        if not (fence.here or fence.registered(wait=1.0)):   # (the broker's barrier must reach this process first)
            return None
        self._slow = None
        pools = self._pools
        if pools.unmapped:   # (pools imported for another use: their directories now)
            pools.map_directories()
        dirs = pools.directories
        if not dirs:
            if pools.imported or "default" not in self._channel.pool_names:
                return None
            try:
                pools.get("default")   # a reader's first get: the usual pool, once
            except IpcPoolError:
                return None
            pools.map_directories()
            dirs = pools.directories
            if not dirs:
                return None
        # The usual reader finds its entry at once: no change counts read, nothing set up to wait.
        got = self._found(dirs, name, stream, timeout)
        if got is not _MISSING:
            return got
        spin = 0.0 if timeout == 0 else self._channel.get_spin_s
        began = time.perf_counter()
        spin_until = began + spin
        made = not spin   # (no spin: nothing to make meanwhile)
        wake = None       # the get that only wakes this reader, once sent; True once answered
        looked_until = 0.0   # ... and until when a reader answered looks again (``ANSWERED_LOOK_S``)
        # (asleep on the directory itself where there is one to look in: ``_doze``)
        bed = next(iter(dirs.values()))[0] if len(dirs) == 1 and futex.usable else None
        try:
            while True:
                changes = [view.change() for view, _ in dirs.values()]   # (before the look: no entry missed)
                got = self._found(dirs, name, stream, timeout)
                if got is not _MISSING:
                    self._drop_wake(wake)   # (found before its answer came)
                    return got
                if not made:   # waiting: the leases the entry will most likely name, made meanwhile
                    made = True
                    self._next.make(self._arena_of, self._lease_at)
                    if self._pools.unpopulated:
                        self._pools.populate()
                while [view.change() for view, _ in dirs.values()] == changes:
                    if time.perf_counter() < spin_until:
                        continue
                    if wake is True or timeout == 0:   # (answered, and no entry here: the broker serves it)
                        if wake is True and timeout != 0 and time.perf_counter() < looked_until:
                            continue   # (an entry mid-write: its change comes once the broker runs)
                        return None
                    if wake is None:
                        # The broker is asked to wake this reader, and the spin goes on meanwhile: an
                        # entry that comes before the answer is read at once, not a round trip later.
                        wake = self._send_wake(name, "entry", timeout, began)
                        spin_until = time.perf_counter() + spin
                        continue
                    if self._doze(wake, bed, changes[0]):   # asleep until the object exists (or a while)
                        wake = True
                        looked_until = time.perf_counter() + ANSWERED_LOOK_S
                    break
        finally:
            self._drop_wake(wake)   # (interrupted, say)

    def _arena_for(self, pool: str, entry: Any) -> ImportedMemory | None:
        """Import the arena ``entry`` lies in, once (``dir_export``); None where it cannot serve
        a reader without a request of its own each time (not an arena, or not a slab range)."""
        try:
            export = Allocation.decode(self._channel.call("dir_export", pool=pool, alloc=entry.alloc)).export
            client_pool = self._pools.get(pool)
            if client_pool.seal_event and not export.sub:
                return None   # a pool allocation of its own: imported and released per lease
            memory = self._pools.import_allocation(entry.alloc, pool, export)
        except IpcPoolError as exc:
            log.debug("arena %d of pool %r not imported for a directory read: %s", entry.alloc, pool, exc)
            return None
        self._arena_views.setdefault(pool, {})[entry.alloc] = memory
        return memory

    def _found(self, dirs: dict, name: str, stream: Any, timeout: float | None) -> Any:
        """The lease on ``name`` where a directory of ``dirs`` (pool -> (view, pool number)) has
        its entry, or None where the broker serves it instead; ``_MISSING`` where none has. Where
        C can (``ClientLeasePage.take_in_c``), the lookup, the hazard slot and the entry's state
        after it are one call, and the usual lease is taken from here (a get runs on a CPU its
        sleep left cold: each call on its way costs ~1 µs on an H100 host)."""
        page = self._pools.lease_page
        # (C built, and not switched off: ``shm.native``; its call bound to the page, no frame between)
        take = page.take_in_c if page is not None and leases.native_take is not None else None
        for pool, (view, pidx) in dirs.items():
            taken = None
            if take is not None:
                got = take(view.mapping, view.capacity, view.probes, name.encode(), pidx,
                           self._arena_views.get(pool, _NO_ARENAS), timeout == 0, self._next.made.get(pool),
                           self._imported[pool].open_credits)
                if got is None:
                    continue
                if got[0] is None:   # sealed, done, and where a lease made ahead lies: nothing more to do
                    return self._next.hit(name, got[5], (pidx, got[3], got[4], got[1], got[2]), self._entered)
                entry, taken = leases.taken(got)
            else:
                entry = view.lookup(name)
                if entry is None:
                    continue
            if trace.hook is not None:
                trace.emit("client.entry_found", name=name)
            if taken is None:
                return self._take(pool, view, pidx, entry, name, stream, timeout)
            # Its slot taken in C, and its state read after that (None: being written all along).
            state = taken[1] if taken[1] is not None else view.state(entry.index, entry.gen)
            return self._lease_taken(pool, view, entry, name, stream, timeout,
                                     self._arena_views[pool][entry.alloc],
                                     (pidx, entry.index, entry.gen, *taken[0]), state)
        return _MISSING

    def _take(self, pool: str, view: Any, pidx: int, entry: Any, name: str, stream: Any,
              timeout: float | None) -> Any:
        """The lease on ``entry``, found for ``name`` in ``pool``'s directory: hazard slot first,
        then the entry checked again, then the memory (``shm.leases``). None where the broker
        serves it instead."""
        if entry.has_user_meta or not entry.in_arena:   # the broker serves those
            return None
        if timeout == 0 and entry.state != directory.SEALED:   # the broker says why not
            return None
        arena = self._arena_views.get(pool, _NO_ARENAS).get(entry.alloc)   # (``_arena_of``)
        if arena is None:
            arena = self._arena_for(pool, entry)
            if arena is None:
                return None
        page = self._pools.lease_page
        got = page.take(pidx, entry.index, entry.gen)
        if got is None and self._releasing:   # every slot waits for its release's answer: the first
            ch = self._channel
            ch.wait_reply(-1, ch.timeout, until=lambda: page.free_slots > 0)
            got = page.take(pidx, entry.index, entry.gen)
        if got is None:
            return None
        lease = (pidx, entry.index, entry.gen, *got)
        return self._lease_taken(pool, view, entry, name, stream, timeout, arena, lease,
                                 view.state(entry.index, entry.gen))

    def _lease_taken(self, pool: str, view: Any, entry: Any, name: str, stream: Any, timeout: float | None,
                     arena: ImportedMemory, lease: tuple, state: int) -> Any:
        """``_take`` once its hazard slot is ``lease`` and ``state`` the entry's after it."""
        if state == directory.GONE:
            self._end_lease(pool, lease, b"")
            if entry.state != directory.SEALED:   # given up before its seal: as ``_await_entry`` says it
                raise ObjectAborted.of(name)
            return None   # (deleted since: the broker says what there is now)
        at = (pool, entry.alloc, entry.offset, entry.size, entry.dtype, entry.shape)
        buf = self._next.take(at, arena)
        if buf is None:
            buf = self._lease_at(at, arena, ahead=state != directory.SEALED)   # (its view made while the writer works)
        buf.name = name
        self._entered[id(buf)] = buf
        buf.dirlease = lease
        try:
            event, kept = entry.event, entry.kept_event
            if state != directory.SEALED:
                event, kept = self._await_entry(buf, view, entry, timeout)
            if trace.hook is not None:
                trace.emit("client.seal_seen", name=name)
            self._imported[pool].order_after(event, stream, kept)
            if trace.hook is not None:
                trace.emit("client.ordered", name=name)
        except BaseException:
            buf.free(stream)
            raise
        return buf

    def _arena_of(self, pool: str, alloc: int) -> ImportedMemory | None:
        """This reader's import of arena ``alloc`` of ``pool``, where it has one."""
        return self._arena_views.get(pool, {}).get(alloc)

    def _lease_at(self, at: tuple, arena: ImportedMemory, ahead: bool = True) -> Any:
        """A read lease's buffer, not yet entered or named, over ``at`` (pool, arena, offset,
        size, dtype, shape) of ``arena`` (its import), with its tensor where tensors are asked for
        and ``ahead``."""
        pool, _, offset, size, dtype, shape = at
        meta = {}
        if dtype is not None:
            meta["dtype"] = dtype
        if shape is not None:
            meta["shape"] = list(shape)
        memory = self._imported[pool].carved(arena, offset, size)
        buf = self._keep(0, pool, memory, False, None, meta, True, enter=False)
        if ahead and self._views.asked:
            buf.tensor_ahead = self._views.ahead(buf, memory)
        return buf

    def _await_entry(self, buf: Any, view: Any, entry: Any, timeout: float | None) -> tuple[bytes, bool]:
        """Until the object of ``entry`` is sealed: its board word, else its entry; the event its
        seal is recorded on, and whether that is a credit to keep open. Spins for the get spin
        budget, then sleeps on the object's board word, which the writer's post wakes (no request:
        ``sealboard``); without one, until the broker has the seal (``_send_wake``)."""
        board = self.boards.get(buf.pool)
        deadline = None if timeout is None else time.monotonic() + timeout
        began = time.perf_counter()
        spin = self._channel.get_spin_s
        spin_until = began + spin
        wake = None   # as ``look``'s
        bed = view if futex.usable else None
        pause = 20e-6
        word, seq = entry.word, entry.seq
        on_board = word is not None and board is not None and board.sleeps
        posted = 0
        try:
            while True:
                seen = view.change()   # (before the looks: a change after them ends a sleep at once)
                if word is not None and board is not None:
                    posted = board.read(word)
                    if posted == seq:   # (a later number: the word serves another object now)
                        return entry.event, entry.kept_event   # the promised event: recorded before the word was posted
                state = view.state(entry.index, entry.gen)
                if state == directory.SEALED:
                    sealed = view.lookup(buf.name)   # (the seal's own event, where it is not the promised one)
                    if sealed is not None and sealed.gen == entry.gen:
                        return sealed.event, sealed.kept_event
                    return entry.event, entry.kept_event
                if state == directory.GONE:
                    raise ObjectAborted.of(buf.name)
                if deadline is not None and time.monotonic() >= deadline:
                    raise WaitTimeout(f"object {buf.name!r} was not sealed within the timeout")
                if time.perf_counter() < spin_until:
                    continue
                if on_board:   # asleep on the word until the writer posts it (its abort: the broker wakes it)
                    nap = futex.SLICE_S if deadline is None else min(futex.SLICE_S, max(0.0, deadline - time.monotonic()))
                    if board.sleep(word, posted, nap):
                        self._board_slept(buf.name, timeout)
                        continue
                    on_board = False   # (this kernel will not: the broker wakes it instead)
                if wake is None:   # the broker asked to wake this reader at the seal; spinning on meanwhile
                    wake = self._send_wake(buf.name, "seal", timeout, began)
                    spin_until = time.perf_counter() + spin
                elif wake is not True:
                    if self._doze(wake, bed, seen):
                        wake = True
                else:   # (answered, yet not sealed here: a board word seen late, say)
                    time.sleep(pause)
                    pause = min(pause * 2, 1e-3)
        finally:
            self._drop_wake(wake)

    def _board_slept(self, name: str, timeout: float | None) -> None:
        """After a sleep on a board word: what arrived taken in (a broker gone: BrokerGone), and a
        wait without a deadline says, once, what it waits for."""
        self._channel.pump(0)
        if timeout is None:
            self._waits_slowly(name).tick()

    def _waits_slowly(self, name: str) -> SlowWait:
        """The get under way, waiting for ``name`` without a deadline: says once what it waits for."""
        if self._slow is None:
            self._slow = SlowWait(describe("get", {"name": name}))
        return self._slow

    def _send_wake(self, name: str, wake: str, timeout: float | None, began: float) -> int:
        """A get that takes no lease (``protocol``): the broker answers once ``name`` exists
        ("entry") or is sealed or gone ("seal"), and wakes the readers asleep on its pool's
        directory. Sent without waiting; its id (the answer is kept in ``_wakes``). Its error (the
        timeout, counted from ``began``; an abandoned object) is the get's (``_doze``)."""
        fields: dict[str, Any] = {"name": name, "wake": wake}
        if timeout is not None:
            fields["timeout_ms"] = max(1, int(max(0.0, timeout - (time.perf_counter() - began)) * 1000))
        else:
            self._waits_slowly(name)
        rid = self._channel.send("get", **fields)
        self._wakes[rid] = None
        self.wakes_sent += 1
        return rid

    def _doze(self, rid: int, bed: Any, seen: int) -> bool:
        """One sleep of a reader whose wake ``rid`` is not answered: on ``bed``'s change count
        (a directory: ``futex``) until it moves from ``seen`` or ``futex.SLICE_S`` passes, then
        what arrived taken in; without a bed, on the channel until the answer. True once the
        answer is here (its error raised: the get's)."""
        ch = self._channel
        if bed is not None and bed.sleep(seen, futex.SLICE_S):
            ch.pump(0)   # (the answer, and a broker gone: BrokerGone)
            if self._slow is not None:
                self._slow.tick()
        elif self._wakes.get(rid) is None:
            ch.wait_reply(-1, None, until=lambda: self._wakes.get(rid) is not None, spin=0.0, slow=self._slow)
        reply = self._wakes.get(rid)
        if reply is None:
            return False
        del self._wakes[rid]
        if not reply.get("ok"):
            raise protocol.refusal(reply)
        return True

    def _drop_wake(self, wake: Any) -> None:
        """A wake whose answer nobody waits for any more (the object was found first): dropped
        when it comes, or now where it came."""
        if type(wake) is int and wake in self._wakes:
            got = self._wakes[wake]
            if got is None:
                self._wakes[wake] = _DROP
            elif got is not _DROP:
                del self._wakes[wake]

    def end_lease(self, buf: Any, stream: Any) -> None:
        """Release a lease taken from a directory: the done event after the reader's work (R2).
        A reader that asks the broker nothing else would never read the answers that free its
        slots: they are taken in here, off the read's path, once few slots are left."""
        done = self.release(buf.pool, buf.memory, stream, if_busy=True)
        self._end_lease(buf.pool, buf.dirlease, done)
        if self._pools.lease_page.free_slots < LOW_SLOTS:
            self._channel.drain()
        self._next.make(self._arena_of, self._lease_at)   # (after the release: its answer need not wait)
        if self._pools.unpopulated:
            self._pools.populate()

    def _end_lease(self, pool: str, lease: tuple, done: bytes) -> None:
        pidx, index, gen, slot, nonce = lease
        rid = self._channel.send("release", pool_index=pidx, entry=index, gen=gen, slot=slot, nonce=nonce,
                                 **({"done_event": done} if done else {}))
        self._releasing[rid] = slot   # the slot is ours again once the broker has read this

    # -- reader: answered by the broker --------------------------------------------------------------
    def await_seal(self, buf: Any, lease: Lease, stream: Any, timeout: float | None) -> None:
        """A pending lease: wait until its object is sealed (the board word, else the broker's
        notice), then order ``stream`` after the seal. The lease is freed if that fails."""
        ch = self._channel
        aid, word, seq, event = lease.alloc, lease.word, lease.seq, lease.export.ready_event
        board = self.boards.get(buf.pool)
        if board is None or not isinstance(word, int) or not isinstance(seq, int) or not isinstance(event, bytes):
            buf.free(stream)
            raise ProtocolError("a pending lease without its board word")
        self._notes[aid] = None
        deadline = None if timeout is None else time.monotonic() + timeout
        spin_until = time.perf_counter() + ch.get_spin_s
        try:
            spins = 0
            while board.read(word) != seq:   # (a later number: the word serves another object now)
                note = self._notes[aid]
                if note is not None:
                    if isinstance(note, AbortNotice):
                        raise ObjectAborted.of(buf.name)
                    event = note.event
                    break
                if deadline is not None and time.monotonic() >= deadline:
                    raise WaitTimeout(f"object {buf.name!r} was not sealed within the timeout")
                spins += 1
                if time.perf_counter() < spin_until:
                    if spins % 32 == 0:
                        ch.drain()
                else:   # sleep until something arrives (the notice comes with the seal)
                    left = 0.01 if deadline is None else max(0.0, min(0.01, deadline - time.monotonic()))
                    ch.pump(left)
            self._imported[buf.pool].order_after(event, stream)
        except BaseException:
            buf.free(stream)
            raise
        finally:
            self._notes.pop(aid, None)


def _naming(err: IpcPoolError, op: str, name: str | None) -> IpcPoolError:
    """A refusal that arrives after the caller moved on says which request it was."""
    if name is not None and repr(name) not in str(err):
        err.args = (f"{op} of {name!r} refused: {err}",)
    return err
