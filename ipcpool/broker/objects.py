"""Named objects: create (one writer) -> seal -> get (leases) -> delete, and who waits for what.

An object is one holder of its allocation (see ``registry``); its writer and each reader are
others. So the memory is freed exactly once, after the object is deleted and every session that
touched it has let go, each with its done event (R2). Waiting ``get``s and prefix watches are kept
here; the server sends their replies when a seal (or an abort, or a timeout) settles them.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import (
    InvalidRequest,
    IpcPoolError,
    ObjectExists,
    ObjectNotFound,
    QuotaExceeded,
)
from ..frames import Create
from .arenas import Arena
from .registry import Allocation, Registry
from .session import Session

try:   # the usual create's checks, range and entry in C (``shm/_native.c``), where built
    from ..shm._native import usual_create as _usual_create
except ImportError:   # (``ObjectTable.create`` does every create then)
    _usual_create = None

log = logging.getLogger(__name__)
_new = tuple.__new__   # (a Create without its generated ``__new__``, a Python call)


@dataclass(eq=False)
class NamedObject:
    name: str
    alloc: Allocation
    writer: Session | None
    meta: dict
    created: float = field(default_factory=time.time)
    sealed: bool = False
    seal_event: bytes = b""
    fdkey: str | None = None   # its VMM chunk FDs' name in systemd's FD store, once stored
    # Carved with a seal-board word: the writer posts ``seq`` there once it has recorded its seal
    # on ``promised`` (an event of the broker's; empty where the backend has none). Readers who
    # ask before the seal get a *pending* lease at once and watch the word (``pending``).
    word: int | None = None
    seq: int = 0
    promised: bytes = b""
    pending: list = field(default_factory=list)
    entry: tuple[int, int, int] | None = None   # (pool, index, gen) in its pool's name directory

    @property
    def state(self) -> str:
        return "sealed" if self.sealed else "writing"

    def leases(self) -> int:
        return sum(n for h, n in self.alloc.holders.items() if isinstance(h, Session) and h is not self.writer)

    def info(self, hazards: dict | None = None) -> dict:
        """``hazards``: leases taken from a directory, by entry (``Directories.hazards``)."""
        extra = hazards.get(self.entry, 0) if hazards and self.entry is not None else 0
        return {
            "name": self.name, "size": self.alloc.size, "pool": self.alloc.pool.spec.name,
            "state": self.state, "leases": self.leases() + extra, "created": self.created, "meta": self.meta,
        }


@dataclass(eq=False)
class Waiter:
    """A ``get`` that arrived before its object was sealed; answered later."""

    session: Session
    rid: int
    deadline: float | None
    name: str = ""
    done: bool = False   # settled (sealed, aborted, timed out or its session gone)
    wake: str | None = None   # a get that takes no lease, only its answer ({}): ``protocol``'s "wake"


@dataclass(eq=False)
class Watch:
    wid: int
    session: Session
    prefix: str


class ObjectTable:
    def __init__(self, registry: Registry, directory=None, handoffs=None):
        self.registry = registry
        self.directory = directory   # broker.directory.Directories: entries readers see without a reply
        self.handoffs = handoffs     # broker.arenas.Handoffs: the arenas carved objects come from
        # One state per object: a seal a reader may have seen on the board (``board_word(pool,
        # word)``) is the broker's too before any answer about the object (``caught_up``); then
        # ``on_board_seal(obj)`` tells the waiting and records it, as the seal's message would.
        self.board_word: Callable[[str, int], int] | None = None
        self.on_board_seal: Callable[[NamedObject], None] = lambda obj: None
        self.board_sealed: dict[tuple[Session, str], int] = {}   # (writer, name) -> alloc: its message due
        self.objects: dict[str, NamedObject] = {}
        # By name, each an ordered set (dict): a seal finds its own without a scan, and a timed-out
        # or gone waiter leaves its set in O(1).
        self.waiters: dict[str, dict[Waiter, None]] = {}
        self.watches: dict[int, Watch] = {}
        self._by_prefix: dict[str, dict[int, Watch]] = {}   # a seal looks up its name's prefixes only
        # prefix -> session -> its watches there: a seal is told once per watching session, however
        # many watches it holds (its client fans the notice out to them).
        self._sessions_by_prefix: dict[str, dict[Session, dict[int, None]]] = {}
        self.objects_by_uid: collections.Counter = collections.Counter()   # (the objects quota: no scan)
        self.watches_by_uid: collections.Counter = collections.Counter()
        self._next_wid = 1
        # Parked gets by deadline (a heap; settled ones are skipped when they reach the top), by
        # session and counted by uid: nothing the event loop does per request scans them all.
        self._deadlines: list[tuple[float, int, Waiter]] = []
        self._seq = itertools.count()
        self._by_session: dict[Session, set[Waiter]] = {}
        self.waits_by_uid: collections.Counter = collections.Counter()
        self._timed = 0   # parked gets with a deadline (the heap holds them and settled ones)
        self.parked_at = 0.0   # when the last get parked (monotonic s): the broker busy-polls after it

    def create(self, session: Session, name: str, nbytes: int, pool: str, meta: dict, arena: Arena | None = None,
               offset: int = 0, word: int | None = None, seq: int = 0, promised: bytes = b"") -> NamedObject:
        """A new object being written by ``session``: a fresh allocation of ``pool``, or the range
        at ``offset`` of the session's ``arena`` (``Handoffs.own``); ``word``: its seal-board
        word, ``seq`` the number the writer will post there, and ``promised`` the event it
        promised to record its seal on.

        A carved object's directory entry is written as soon as its range is checked: what a
        reader spins on comes before the rest of the bookkeeping (``Directories.publish``)."""
        if name in self.objects:
            raise ObjectExists(f"an object named {name!r} already exists; delete it first or pick another name")
        uid = session.cred.uid
        limit = self.registry.config.quota_for(uid).objects
        if limit and self.objects_by_uid.get(uid, 0) >= limit:
            raise QuotaExceeded(
                f"uid {uid} has {limit} named objects, its quota; delete some or ask the operator to raise it"
            )
        directory = self.directory
        if arena is not None:
            self.handoffs.reserve(arena, offset, nbytes)
            entry = directory.publish(arena.alloc.pool.spec.name, name, nbytes, word, seq, promised, meta,
                                      arena.aid, offset) if directory is not None else None
            return self._carved(session, name, nbytes, meta, arena, offset, word, seq, promised, entry)
        alloc = self.registry.allocate(session, nbytes, pool)   # the writer's hold
        entry = directory.publish(pool, name, alloc.size, word, seq, promised, meta, alloc.aid, 0, False) \
            if directory is not None else None
        return self._enter(session, name, alloc, meta, word, seq, promised, entry)

    def create_usual(self, session: Session, data: bytes) -> tuple[Create, NamedObject] | None:
        """A create frame of the usual kind, checked, its range taken and its entry written in one
        C call (``_native.usual_create``, against the arena's ticket: ``Handoffs.tickets``), then
        recorded as ``create`` records it; None, with nothing done: not usual, or refused (or not
        built here): ``create`` does it in Python then, and says why it refuses.
        In Python, the ~20 calls between a create's receipt and its entry cost the broker 15-25 µs
        on an H100 host (each run on caches the loop between creates left cold); the reader waits
        for that entry."""
        directory = self.directory
        if _usual_create is None or directory is None:
            return None
        gen = directory.next_gen()
        got = _usual_create(data, session, self.handoffs.tickets, self.objects, self.objects_by_uid, gen)
        if got is None:
            return None
        c, size, index = _new(Create, got[0]), got[1], got[2]
        arena = self.handoffs.arenas[c.arena]
        self.handoffs.reserved(arena, size)
        promised = c.credit or b""
        entry = directory.entered(arena.alloc.pool.spec.name, c.name, index, gen)
        obj = self._carved(session, c.name, c.nbytes, {}, arena, c.offset, self.handoffs.word(arena, c.slot, c.seq),
                           c.seq, promised, entry)
        return c, obj

    def _carved(self, session: Session, name: str, nbytes: int, meta: dict, arena: Arena, offset: int,
                word: int | None, seq: int, promised: bytes, entry: tuple[int, int, int] | None) -> NamedObject:
        """A carved object whose range is taken in the mirror and entry written (or None): its own
        allocation recorded, else the entry withdrawn."""
        try:
            alloc = self.handoffs.record(session, arena, offset, nbytes)   # the writer's hold
        except BaseException:
            if entry is not None:
                self.directory.withdraw(arena.alloc.pool.spec.name, entry)
            raise
        obj = self._enter(session, name, alloc, meta, word, seq, promised, entry)
        if entry is not None and arena.aid not in self.handoffs.tickets:   # its next creates: checked in C
            self.handoffs.ticket(arena, session, self.directory.of(arena.alloc.pool.spec.name),
                                 self.registry.config.quota_for(session.cred.uid).objects)
        return obj

    def _enter(self, session: Session, name: str, alloc: Allocation, meta: dict, word: int | None, seq: int,
               promised: bytes, entry: tuple[int, int, int] | None) -> NamedObject:
        obj = NamedObject(name, alloc, session, meta, word=word, seq=seq, promised=promised)
        if entry is not None:
            obj.entry = entry
            self.directory.live[entry[:2]] = (entry[2], alloc)
        self.registry.hold(alloc, obj)
        self.objects[name] = obj
        self.objects_by_uid[alloc.uid] += 1
        return obj

    def caught_up(self, obj: NamedObject | None) -> NamedObject | None:
        """``obj``, sealed now where its writer posted its seal on the board and its message is
        still on the way: what a reader sees, every answer says. (A pool's board is trusted as far
        as its clients are: see ``ipcpool.shm.sealboard``.)"""
        if (obj is not None and not obj.sealed and obj.word is not None and obj.writer is not None
                and self.board_word is not None
                and self.board_word(obj.alloc.pool.spec.name, obj.word) == obj.seq):
            writer = obj.writer
            self.seal(writer, obj.name, None, obj.promised)   # the event it promised, recorded before the word
            self.board_sealed[(writer, obj.name)] = obj.alloc.aid
            self.on_board_seal(obj)
        return obj

    def seal(self, session: Session, name: str, aid: int | None, done_event: bytes) -> NamedObject | None:
        """None where the broker had taken this seal from the board already (``caught_up``)."""
        taken = self.board_sealed.get((session, name))
        if taken is not None and aid in (None, taken):   # (its object may be deleted since)
            del self.board_sealed[(session, name)]
            return None
        obj = self.objects.get(name)
        if obj is None or obj.writer is not session or aid not in (None, obj.alloc.aid):
            raise InvalidRequest(f"{name!r} is not an object this session is writing")
        alloc = obj.alloc
        obj.seal_event = alloc.pool.ordering.seal(alloc.handle, session.backend, done_event)
        obj.sealed = True
        obj.writer = None
        if self.directory is not None:
            self.directory.sealed(obj)
        self.registry.free(session, alloc.aid)   # the writer's import: its done event is ordered by seal()
        return obj

    def count_by_uid(self, uid: int) -> int:
        return self.objects_by_uid[uid]

    def restore(self, rows: list[dict], take_fds) -> int:
        """Re-create sealed objects a previous broker recorded (``take_fds(key, count)`` gives a
        VMM-backed one's chunk FDs); returns how many came back."""
        n = 0
        for row in rows:
            try:
                fds: list[int] = []
                if row.get("chunks"):
                    fds = take_fds(row["fdkey"], len(row["chunks"]))
                    if fds is None:
                        raise InvalidRequest("its chunk FDs are not in the store")
                alloc = self.registry.restore(row, fds)
            except (IpcPoolError, KeyError, TypeError, OSError) as exc:
                log.error("stored object %r not restored: %s", row.get("name"), exc)
                continue
            obj = NamedObject(row["name"], alloc, None, row.get("meta") or {}, row.get("created", time.time()),
                              sealed=True, fdkey=row.get("fdkey"))
            self.registry.hold(alloc, obj)
            self.objects[obj.name] = obj
            self.objects_by_uid[obj.alloc.uid] += 1
            n += 1
        return n

    def lease(self, session: Session, name: str) -> NamedObject | None:
        """A read lease on a sealed object, or None where it is not sealed yet."""
        obj = self.caught_up(self.objects.get(name))
        if obj is None or not obj.sealed:
            return None
        self.registry.hold(obj.alloc, session)
        return obj

    def lease_pending(self, session: Session, name: str) -> NamedObject | None:
        """A lease on an object still being written whose seal the reader can see on the board
        (answered now: the reader watches the board), or None where that is not so."""
        obj = self.objects.get(name)
        if obj is None or obj.sealed or obj.word is None:
            return None
        self.registry.hold(obj.alloc, session)
        obj.pending.append(session)
        return obj

    def lease_many(self, session: Session, names: list[str]) -> list[NamedObject]:
        """Leases on every one of ``names``, or none: all must be sealed."""
        get, catch = self.objects.get, self.caught_up
        objs = [get(n) for n in names]
        objs = [o if o is None or o.sealed else catch(o) for o in objs]
        if not all(o is not None and o.sealed for o in objs):
            missing = [n for n, o in zip(names, objs) if o is None or not o.sealed]
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise ObjectNotFound(f"not sealed (or missing): {', '.join(map(repr, missing[:5]))}{more}")
        self.registry.hold_many([o.alloc for o in objs], session)
        return objs

    def awake(self, name: str, wake: str) -> tuple[bool, NamedObject | None]:
        """Whether a get that asks only to be woken is answered now: ``name`` has its directory
        entry ("entry"), or is sealed or gone ("seal": the reader's directory says which); and
        the object, where there is one."""
        obj = self.caught_up(self.objects.get(name))
        return (obj is not None if wake == "entry" else obj is None or obj.sealed), obj

    def wait(self, session: Session, name: str, rid: int, timeout_s: float | None, wake: str | None = None) -> None:
        if timeout_s == 0:
            obj = self.objects.get(name)
            state = "is still being written" if obj else "does not exist"
            raise ObjectNotFound(f"object {name!r} {state}; pass a timeout to wait for its seal")
        uid = session.cred.uid
        _check_cap(uid, self.waits_by_uid[uid], self.registry.config.waits_per_uid, "gets waiting for a seal",
                   "waits_per_uid", "wait with a timeout, or for fewer objects at once")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        w = Waiter(session, rid, deadline, name, wake=wake)
        self.parked_at = time.monotonic()
        self.waiters.setdefault(name, {})[w] = None
        self._by_session.setdefault(session, set()).add(w)
        self.waits_by_uid[uid] += 1
        if deadline is not None:
            self._timed += 1
            if len(self._deadlines) > 2 * self._timed + 1024:   # mostly settled: drop those
                self._deadlines = [e for e in self._deadlines if not e[2].done]
                heapq.heapify(self._deadlines)
            heapq.heappush(self._deadlines, (deadline, next(self._seq), w))

    def _settled(self, w: Waiter) -> None:
        w.done = True
        if w.deadline is not None:
            self._timed -= 1
        ws = self._by_session.get(w.session)
        if ws is not None:
            ws.discard(w)
            if not ws:
                del self._by_session[w.session]
        uid = w.session.cred.uid
        self.waits_by_uid[uid] -= 1
        if self.waits_by_uid[uid] <= 0:
            del self.waits_by_uid[uid]

    def _unpark(self, w: Waiter) -> None:
        ws = self.waiters.get(w.name)
        if ws is not None:
            ws.pop(w, None)
            if not ws:
                del self.waiters[w.name]
        self._settled(w)

    def take_waiters(self, name: str) -> list[Waiter]:
        ws = list(self.waiters.pop(name, ()))
        for w in ws:
            self._settled(w)
        return ws

    def expired(self, now: float) -> list[tuple[str, Waiter]]:
        out = []
        heap = self._deadlines
        while heap and (heap[0][2].done or heap[0][0] <= now):
            _, _, w = heapq.heappop(heap)
            if w.done:
                continue
            self._unpark(w)
            out.append((w.name, w))
        return out

    def next_deadline(self) -> float | None:
        heap = self._deadlines
        while heap and heap[0][2].done:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def delete(self, session: Session, name: str) -> NamedObject:
        obj = self.caught_up(self.objects.get(name))
        if obj is None:
            raise ObjectNotFound(f"no object named {name!r}")
        if not obj.sealed and obj.writer is not session:
            raise InvalidRequest(f"object {name!r} is being written by another session; only its writer may delete it now")
        self._drop(obj)
        return obj

    def abandon(self, session: Session, name: str, aid: int) -> NamedObject | None:
        """``session`` gave up the object ``name`` it writes in allocation ``aid`` before its seal:
        dropped (the caller tells its readers it is aborted). None where ``name`` is no unsealed
        object of that session's in ``aid`` (deleted since, or posted sealed on the board)."""
        obj = self.caught_up(self.objects.get(name))
        if obj is None or obj.writer is not session or obj.alloc.aid != aid:
            return None
        self._drop(obj)
        return obj

    def _drop(self, obj: NamedObject) -> None:
        del self.objects[obj.name]
        if self.directory is not None:   # its directory readers become holders first
            self.directory.gone(obj)
        uid = obj.alloc.uid
        self.objects_by_uid[uid] -= 1
        if self.objects_by_uid[uid] <= 0:
            del self.objects_by_uid[uid]
        # The object's own hold; the memory goes once the readers (and a writer) let go too.
        self.registry.unhold(obj.alloc, obj, b"", None)

    def watch(self, session: Session, prefix: str) -> Watch:
        uid = session.cred.uid
        _check_cap(uid, self.watches_by_uid[uid], self.registry.config.watches_per_uid, "watches",
                   "watches_per_uid", "close some subscriptions first")
        w = Watch(self._next_wid, session, prefix)
        self._next_wid += 1
        self.watches[w.wid] = w
        self._by_prefix.setdefault(prefix, {})[w.wid] = w
        self._sessions_by_prefix.setdefault(prefix, {}).setdefault(session, {})[w.wid] = None
        self.watches_by_uid[uid] += 1
        return w

    def unwatch(self, session: Session, wid: int) -> None:
        w = self.watches.get(wid)
        if w is None or w.session is not session:
            raise InvalidRequest(f"watch {wid} is not one of this session's")
        self._drop_watch(w)

    def _drop_watch(self, w: Watch) -> None:
        del self.watches[w.wid]
        ws = self._by_prefix[w.prefix]
        del ws[w.wid]
        if not ws:
            del self._by_prefix[w.prefix]
        by_session = self._sessions_by_prefix[w.prefix]
        del by_session[w.session][w.wid]
        if not by_session[w.session]:
            del by_session[w.session]
            if not by_session:
                del self._sessions_by_prefix[w.prefix]
        uid = w.session.cred.uid
        self.watches_by_uid[uid] -= 1
        if self.watches_by_uid[uid] <= 0:
            del self.watches_by_uid[uid]

    def watchers(self, name: str) -> list[Watch]:
        """The watches whose prefix ``name`` starts with: one lookup per prefix of the name."""
        out: list[Watch] = []
        for i in range(len(name) + 1):
            ws = self._by_prefix.get(name[:i])
            if ws:
                out.extend(ws.values())
        return out

    def watching_sessions(self, name: str) -> dict[Session, int]:
        """The sessions with a watch whose prefix ``name`` starts with, each with one of those
        watches' ids: one lookup per prefix of the name, one entry per session."""
        out: dict[Session, int] = {}
        for i in range(len(name) + 1):
            by_session = self._sessions_by_prefix.get(name[:i])
            if by_session:
                for session, wids in by_session.items():
                    if session not in out:
                        out[session] = next(iter(wids))
        return out

    def end_session(self, session: Session) -> tuple[list[NamedObject], list[tuple[str, Waiter]]]:
        """A session is gone: abort what it was writing, forget its waits and watches. Returns the
        aborted objects and the waiters (of any session) that were waiting for them."""
        for key in [k for k in self.board_sealed if k[0] is session]:
            del self.board_sealed[key]
        for w in [w for w in self.watches.values() if w.session is session]:
            self._drop_watch(w)
        for w in list(self._by_session.get(session, ())):
            self._unpark(w)
        aborted = [o for o in self.objects.values() if o.writer is session]
        orphans = []
        for obj in aborted:
            self._drop(obj)
            orphans += [(obj.name, w) for w in self.take_waiters(obj.name)]
        return aborted, orphans


def _check_cap(uid: int, held: int, limit: int, what: str, key: str, hint: str) -> None:
    """Refuse one more of ``what`` for ``uid`` where it holds ``limit`` already (0: no limit)."""
    if limit and held >= limit:
        raise QuotaExceeded(f"uid {uid} has {held} {what}, its limit ({key} in the broker's [limits]); {hint}")
