"""The broker's side of reading without a reply: each pool's name directory, each session's lease
page, and the rule that joins them.

An object's entry is published the moment its create is accepted, marked sealed at its seal, and
marked gone before its memory can go (delete, abort). Marking it gone runs the fence and reads the
lease pages of the pool's sessions: every slot that names the object becomes a hold of that session
(``Registry.hold``), ended by the session's ``release`` with its done event (R2), or by its end.
A release of a lease whose object is still there orders the eventual free after its done event.
So memory a directory reader may still read is never freed or reused (``shm.leases``).
"""

from __future__ import annotations

import collections
import logging
import time

from .. import trace
from ..errors import InvalidRequest
from ..shm import directory as layout
from ..shm.fence import Fence
from ..shm.leases import SLOTS, LeasePage
from .registry import Allocation, Registry
from .session import Session

log = logging.getLogger(__name__)

# Lease pages made ahead while the broker is idle (``stock_pages``): a session's first pool import
# takes one, where making it (a memfd, its seals, its mapping: ~0.1 ms measured in a broker) would
# hold up the reply, and with it a restarted worker's attach.
SPARE_PAGES = 2


class Directories:
    def __init__(self, registry: Registry, capacity: int = layout.CAPACITY):
        self.registry = registry
        self.capacity = capacity
        self.fence = Fence()
        self.by_pool: dict[str, layout.Directory] = {}
        self.pool_index: dict[str, int] = {}
        self.pool_names: list[str] = []   # by pool index
        self.live: dict[tuple[int, int], tuple[int, Allocation]] = {}   # (pool, entry) -> (gen, alloc)
        self.pages: dict[Session, LeasePage] = {}
        self.spare_pages: list[LeasePage] = []   # made ahead, never handed out yet
        self._stock_failed = False
        self.readers: dict[int, set[Session]] = {}   # pool index -> sessions with its directory
        self.converted: dict[tuple[Session, int, int], Allocation] = {}   # (session, slot, nonce) -> held
        self._gen = 0
        # The broker's own budget for a create: from the message's receipt to its entry, in ns
        # (``received`` is set by the loop as it takes each message in); the latest few thousand.
        self.received = 0
        self.create_to_entry: collections.deque[int] = collections.deque(maxlen=4096)
        self.checked_in_c = 0   # creates checked up to their entry in C (``entered``), ever
        if not self.fence.usable:
            log.warning("membarrier is not available: readers will ask the broker for every object")

    @property
    def usable(self) -> bool:
        return self.capacity > 0 and self.fence.usable

    def of(self, pool_name: str) -> layout.Directory | None:
        """Pool ``pool_name``'s directory (made the first time a client imports the pool)."""
        if not self.usable:
            return None
        d = self.by_pool.get(pool_name)
        if d is None:
            d = self.by_pool[pool_name] = layout.Directory(pool_name, self.capacity)
            self.pool_index[pool_name] = len(self.pool_index)
            self.pool_names.append(pool_name)
        return d

    def awake(self, until_ns: int) -> None:
        """The broker busy-polls until ``until_ns`` (``shm.requests``): told in every directory."""
        for d in self.by_pool.values():
            d.awake(until_ns)

    def page(self, session: Session, pool_name: str) -> LeasePage | None:
        """The session's lease page, made with its first directory; None where it has one already
        (its FD went out before)."""
        self.readers.setdefault(self.pool_index[pool_name], set()).add(session)
        if session in self.pages:
            return None
        page = self.pages[session] = self.spare_pages.pop() if self.spare_pages else LeasePage()
        self._stock_failed = False
        return page

    def pages_wanted(self) -> bool:
        return len(self.spare_pages) < SPARE_PAGES and not self._stock_failed and self.usable

    def stock_pages(self) -> None:
        """One lease page more made ahead, where fewer than SPARE_PAGES are (the loop's idle pass)."""
        if self.pages_wanted():
            try:
                self.spare_pages.append(LeasePage())
            except OSError as exc:   # (out of FDs or memory, say: a session then makes its own, and says why)
                log.debug("no lease page made ahead: %s", exc)
                self._stock_failed = True   # (tried again once a session took its page)

    # -- what the object table tells us ---------------------------------------------------------
    def publish(self, pool_name: str, name: str, size: int, word: int | None, seq: int, promised: bytes,
                meta: dict, alloc: int, offset: int, in_arena: bool = True) -> tuple[int, int, int] | None:
        """A new object's entry, the first thing done with its create: (pool, index, gen), or None
        (no directory, or no free slot on its probe: readers ask the broker). ``alloc``, ``offset``:
        the arena's allocation and the offset in it for an object carved from an arena, else its
        own allocation and 0 with ``in_arena`` False. The caller enters it in ``live`` once the
        object's allocation exists."""
        d = self.by_pool.get(pool_name)
        if d is None:
            return None
        gen = self._gen = self._gen + 1
        if meta:
            dtype, shape, user = meta.get("dtype"), meta.get("shape"), bool(meta.get("user"))
        else:   # (a hand-off's bytes: no metadata to look into)
            dtype = shape = None
            user = False
        index = d.publish(name, gen, layout.WRITING, alloc, offset, size, word, seq, promised, dtype, shape, user,
                          in_arena, promised != b"")
        if index is None:
            return None
        if self.received:
            self.create_to_entry.append(time.perf_counter_ns() - self.received)
        if trace.hook is not None:
            trace.emit("broker.entry", pool=pool_name, name=name, index=index)
        return self.pool_index[pool_name], index, gen

    def next_gen(self) -> int:
        """The number the next entry gets (taken by ``entered``)."""
        return self._gen + 1

    def entered(self, pool_name: str, name: str, index: int | None, gen: int) -> tuple[int, int, int] | None:
        """An entry written in C (``ObjectTable.create_usual``) as ``next_gen`` numbered it, at
        ``index`` (None: its probe found no free entry): as ``publish`` returns it."""
        self._gen = gen
        self.checked_in_c += 1
        if index is None:
            return None
        self.by_pool[pool_name].written(index, name.encode())
        if self.received:
            self.create_to_entry.append(time.perf_counter_ns() - self.received)
        return self.pool_index[pool_name], index, gen

    def withdraw(self, pool_name: str, entry: tuple[int, int, int]) -> None:
        """An entry whose create failed after it was written (no reader can hold it yet: nothing
        is allocated for it)."""
        self.by_pool[pool_name].set_state(entry[1], entry[2], layout.GONE)

    def wake(self, pool_name: str) -> None:
        """Wake the readers asleep on ``pool_name``'s directory (a wake request answered)."""
        d = self.by_pool.get(pool_name)
        if d is not None:
            d.wake_sleepers()

    def sealed(self, obj) -> None:
        if obj.entry is not None:
            pool, index, gen = obj.entry
            d = self.by_pool[obj.alloc.pool.spec.name]
            event = obj.seal_event if obj.seal_event != obj.promised else None
            d.set_state(index, gen, layout.SEALED, event=event)

    def gone(self, obj) -> None:
        """Before the object's hold goes: its entry marked gone, then every reader that may have
        taken it from the directory made a holder (after the fence: see ``shm.fence``)."""
        if obj.entry is None:
            return
        pool, index, gen = obj.entry
        obj.entry = None
        self.by_pool[obj.alloc.pool.spec.name].set_state(index, gen, layout.GONE)
        self.live.pop((pool, index), None)
        readers = [s for s in self.readers.get(pool, ()) if s in self.pages]
        if not readers:
            return
        self.fence()
        for session in readers:
            for slot, p, e, g, nonce in self.pages[session].live():
                if (p, e, g) == (pool, index, gen) and (session, slot, nonce) not in self.converted:
                    self.registry.hold(obj.alloc, session)
                    self.converted[(session, slot, nonce)] = obj.alloc

    def timing(self) -> dict:
        """The broker's create-to-entry time over its latest creates (p50, p99, µs), and how many
        creates were checked in C (``ObjectTable.create_usual``), for stats."""
        xs = sorted(self.create_to_entry)
        if not xs:
            return {"creates": 0, "checked_in_c": self.checked_in_c}
        return {"creates": len(xs), "checked_in_c": self.checked_in_c, "create_to_entry_p50_us": xs[len(xs) // 2] / 1000,
                "create_to_entry_p99_us": xs[min(len(xs) - 1, len(xs) * 99 // 100)] / 1000}

    def hazards(self) -> dict[tuple[int, int, int], int]:
        """Leases taken from a directory and not yet converted into holds, by (pool, entry, gen):
        what ``list`` adds to an object's lease count (read without the fence: a count to show)."""
        out: dict[tuple[int, int, int], int] = {}
        for session, page in self.pages.items():
            for slot, p, e, g, nonce in page.live():
                if (session, slot, nonce) not in self.converted:
                    out[(p, e, g)] = out.get((p, e, g), 0) + 1
        return out

    # -- a reader's release ---------------------------------------------------------------------
    def release(self, session: Session, f: dict):
        """A directory lease ends (``done_event``: R2); its pool. Its slot is the session's to
        reuse once answered."""
        page = self.pages.get(session)
        slot, nonce = f["slot"], f["nonce"]
        if page is None or not 0 <= slot < SLOTS:
            raise InvalidRequest("release: this session has no lease page")
        if not 0 <= f["pool_index"] < len(self.pool_names):
            raise InvalidRequest(f"release: no pool has directory {f['pool_index']}")
        pool = self.registry.pool(self.pool_names[f["pool_index"]])
        done = f.get("done_event", b"")
        alloc = self.converted.pop((session, slot, nonce), None)
        page.released[slot] = nonce
        if alloc is not None:
            self.registry.free(session, alloc.aid, done)
            return pool
        got = self.live.get((f["pool_index"], f["entry"]))
        if got is not None and got[0] == f["gen"]:   # still there: the free waits for this reader too
            self.registry.hold(got[1], session)
            self.registry.free(session, got[1].aid, done)
        return pool

    def export_of(self, session: Session, pool_name: str, aid: int) -> Allocation:
        """The allocation a directory entry of ``pool_name`` names, for a reader to import once."""
        alloc = self.registry.allocations.get(aid)
        if alloc is None or alloc.pool.spec.name != pool_name or session not in self.readers.get(
                self.pool_index.get(pool_name, -1), ()):
            raise InvalidRequest(f"allocation {aid} is not one a directory of pool {pool_name!r} names to this session")
        return alloc

    def end_session(self, session: Session) -> None:
        page = self.pages.pop(session, None)
        if page is not None:
            page.close()
        for readers in self.readers.values():
            readers.discard(session)
        for key in [k for k in self.converted if k[0] is session]:
            del self.converted[key]   # (its holds go with the session's, in Registry.end_session)

    def close(self) -> None:
        for d in self.by_pool.values():
            d.close()
        for page in [*self.pages.values(), *self.spare_pages]:
            page.close()
        self.by_pool.clear()
        self.pages.clear()
        self.spare_pages.clear()
