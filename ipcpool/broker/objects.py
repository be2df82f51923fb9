"""Named objects: create (one writer) -> seal -> get (leases) -> delete, and who waits for what.

An object is one holder of its allocation (see ``registry``); its writer and each reader are
others. So the memory is freed exactly once, after the object is deleted and every session that
touched it has let go, each with its done event (R2). Waiting ``get``s and prefix watches are kept
here; the server sends their replies when a seal (or an abort, or a timeout) settles them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import (
    InvalidRequest,
    IpcPoolError,
    ObjectAborted,
    ObjectExists,
    ObjectNotFound,
    QuotaExceeded,
)
from .registry import Allocation, Registry
from .session import Session

log = logging.getLogger(__name__)


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

    @property
    def state(self) -> str:
        return "sealed" if self.sealed else "writing"

    def leases(self) -> int:
        return sum(n for h, n in self.alloc.holders.items() if isinstance(h, Session) and h is not self.writer)

    def info(self) -> dict:
        return {
            "name": self.name, "size": self.alloc.size, "pool": self.alloc.pool.spec.name,
            "state": self.state, "leases": self.leases(), "created": self.created, "meta": self.meta,
        }


@dataclass(eq=False)
class Waiter:
    """A ``get`` that arrived before its object was sealed; answered later."""

    session: Session
    rid: int
    deadline: float | None


@dataclass(eq=False)
class Watch:
    wid: int
    session: Session
    prefix: str


class ObjectTable:
    def __init__(self, registry: Registry):
        self.registry = registry
        self.objects: dict[str, NamedObject] = {}
        self.waiters: dict[str, list[Waiter]] = {}
        self.watches: dict[int, Watch] = {}
        self._next_wid = 1

    def create(self, session: Session, name: str, nbytes: int, pool: str, meta: dict,
               carve: Callable[[], Allocation] | None = None, board: tuple[int, int, bytes] | None = None) -> NamedObject:
        """A new object being written by ``session``: a fresh allocation of ``pool``, or what
        ``carve()`` gives (a range of the session's arena); ``board``: its seal-board word, the
        number the writer will post there, and the event it promised to record its seal on."""
        if name in self.objects:
            raise ObjectExists(f"an object named {name!r} already exists; delete it first or pick another name")
        uid = session.cred.uid
        limit = self.registry.config.quota_for(uid).objects
        if limit and self.count_by_uid(uid) >= limit:
            raise QuotaExceeded(
                f"uid {uid} has {limit} named objects, its quota; delete some or ask the operator to raise it"
            )
        alloc = carve() if carve is not None else self.registry.allocate(session, nbytes, pool)   # the writer's hold
        obj = NamedObject(name, alloc, session, meta)
        if board is not None:
            obj.word, obj.seq, obj.promised = board
        self.registry.hold(alloc, obj)
        self.objects[name] = obj
        return obj

    def seal(self, session: Session, name: str, aid: int | None, done_event: bytes) -> NamedObject:
        obj = self.objects.get(name)
        if obj is None or obj.writer is not session or aid not in (None, obj.alloc.aid):
            raise InvalidRequest(f"{name!r} is not an object this session is writing")
        alloc = obj.alloc
        obj.seal_event = alloc.pool.seal(alloc.handle, session.backend, done_event)
        obj.sealed = True
        obj.writer = None
        self.registry.free(session, alloc.aid)   # the writer's import: its done event is ordered by seal()
        return obj

    def count_by_uid(self, uid: int) -> int:
        return sum(1 for o in self.objects.values() if o.alloc.uid == uid)

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
            n += 1
        return n

    def lease(self, session: Session, name: str) -> NamedObject | None:
        """A read lease on a sealed object, or None where it is not sealed yet."""
        obj = self.objects.get(name)
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
        objs = [self.objects.get(n) for n in names]
        missing = [n for n, o in zip(names, objs) if o is None or not o.sealed]
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise ObjectNotFound(f"not sealed (or missing): {', '.join(map(repr, missing[:5]))}{more}")
        for obj in objs:
            self.registry.hold(obj.alloc, session)
        return objs

    def wait(self, session: Session, name: str, rid: int, timeout_s: float | None) -> None:
        if timeout_s == 0:
            obj = self.objects.get(name)
            state = "is still being written" if obj else "does not exist"
            raise ObjectNotFound(f"object {name!r} {state}; pass a timeout to wait for its seal")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.waiters.setdefault(name, []).append(Waiter(session, rid, deadline))

    def take_waiters(self, name: str) -> list[Waiter]:
        return self.waiters.pop(name, [])

    def expired(self, now: float) -> list[tuple[str, Waiter]]:
        out = []
        for name, ws in list(self.waiters.items()):
            keep = []
            for w in ws:
                (out.append((name, w)) if w.deadline is not None and w.deadline <= now else keep.append(w))
            if keep:
                self.waiters[name] = keep
            else:
                del self.waiters[name]
        return out

    def next_deadline(self) -> float | None:
        deadlines = [w.deadline for ws in self.waiters.values() for w in ws if w.deadline is not None]
        return min(deadlines, default=None)

    def delete(self, session: Session, name: str) -> NamedObject:
        obj = self.objects.get(name)
        if obj is None:
            raise ObjectNotFound(f"no object named {name!r}")
        if not obj.sealed and obj.writer is not session:
            raise InvalidRequest(f"object {name!r} is being written by another session; only its writer may delete it now")
        self._drop(obj)
        return obj

    def _drop(self, obj: NamedObject) -> None:
        del self.objects[obj.name]
        # The object's own hold; the memory goes once the readers (and a writer) let go too.
        self.registry.unhold(obj.alloc, obj, b"", None)

    def list(self, prefix: str = "") -> list[dict]:
        return [o.info() for name, o in sorted(self.objects.items()) if name.startswith(prefix)]

    def watch(self, session: Session, prefix: str) -> Watch:
        w = Watch(self._next_wid, session, prefix)
        self._next_wid += 1
        self.watches[w.wid] = w
        return w

    def unwatch(self, session: Session, wid: int) -> None:
        w = self.watches.get(wid)
        if w is None or w.session is not session:
            raise InvalidRequest(f"watch {wid} is not one of this session's")
        del self.watches[wid]

    def watchers(self, name: str) -> list[Watch]:
        return [w for w in self.watches.values() if name.startswith(w.prefix)]

    def end_session(self, session: Session) -> tuple[list[NamedObject], list[tuple[str, Waiter]]]:
        """A session is gone: abort what it was writing, forget its waits and watches. Returns the
        aborted objects and the waiters (of any session) that were waiting for them."""
        for wid in [wid for wid, w in self.watches.items() if w.session is session]:
            del self.watches[wid]
        for name, ws in list(self.waiters.items()):
            ws[:] = [w for w in ws if w.session is not session]
            if not ws:
                del self.waiters[name]
        aborted = [o for o in self.objects.values() if o.writer is session]
        orphans = []
        for obj in aborted:
            self._drop(obj)
            orphans += [(obj.name, w) for w in self.take_waiters(obj.name)]
        return aborted, orphans


def abort_error(name: str) -> IpcPoolError:
    return ObjectAborted(f"object {name!r} was abandoned before it was sealed (its writer went away or deleted it)")
