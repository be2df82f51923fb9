"""What each request on the message channel does: one method per op, found by name.

The server hands every validated request here; a method returns the reply's fields, or None when
the reply comes later (a ``get`` waiting for its seal is answered by ``Notices.sealed``). What other
sessions are told goes out through ``Notices``: a handler knows nothing of the server.
"""

from __future__ import annotations

import os
import time

from .. import protocol
from ..frames import Create
from .._version import __version__
from ..errors import InvalidRequest
from .checkpoints import Checkpoint
from .notices import Notices
from ..replies import Arena, Carved, GrowableState, Released, Shared
from .replies import allocation, batch, credit, lease, page, pending
from .session import Session
from .tables import Tables

VERSION = __version__
ARENA_CREDITS = 4   # events handed out with an arena: its first creates' seals need no wait


class Handlers:
    def __init__(self, *, tables: Tables, notices: Notices, sessions: dict[bytes, Session], backend_name: str,
                 started: float):
        self.tables = tables
        self.notices = notices
        self.sessions = sessions   # token -> open session (counted in stats)
        self.backend_name = backend_name
        self.started = started   # when the broker started (time.time())

    def handle(self, session: Session, op: str, fields: dict, rid: int) -> dict | GrowableState | None:
        # validate() admits only known ops, and each has a method here (tests/unit checks both).
        return getattr(self, f"op_{op}")(session, fields, rid)

    # -- anonymous allocations -------------------------------------------------------------------
    def op_allocate(self, session: Session, f: dict, rid: int) -> dict:
        if "arena" in f or "offset" in f:   # carved by the client: it has the memory already
            if "arena" not in f or "offset" not in f:
                raise InvalidRequest("allocate: arena and offset go together")
            alloc = self.tables.handoffs.carve(session, f["arena"], f["offset"], f["nbytes"])
            return Carved(alloc.aid, f["pool"], credit(alloc.pool, session)).encode()
        alloc = self.tables.registry.allocate(session, f["nbytes"], f["pool"])
        return allocation(alloc, credit=credit(alloc.pool, session)).encode()

    def op_free(self, session: Session, f: dict, rid: int) -> dict:
        if ("arena" in f) != ("offset" in f) or ("alloc" in f) == ("arena" in f):
            raise InvalidRequest("free names an allocation: alloc, or arena and offset")
        aid = f["alloc"] if "alloc" in f else self.tables.handoffs.carved(session, f["arena"], f["offset"])
        if "name" in f:   # its writer gave the object up: aborted, as its session's end would
            self.tables.registry.held_by(session, aid)   # (refused before anything changes)
            obj = self.tables.objects.abandon(session, f["name"], aid)
            if obj is not None:
                self._dropped(obj)
        self.tables.registry.free(session, aid, f.get("done_event", b""))
        return {}

    def op_share(self, session: Session, f: dict, rid: int) -> dict:
        return Shared(self.tables.registry.share(session, f["alloc"])).encode()

    def op_open(self, session: Session, f: dict, rid: int) -> dict:
        alloc = self.tables.registry.open(session, f["token"])
        # A fresh ready event on the opener's stream: the one made at allocation may be recycled.
        return allocation(alloc, alloc.pool.ordering.reexport(alloc.handle, alloc.export, session.backend)).encode()

    # -- pools and the session --------------------------------------------------------------------
    def op_stats(self, session: Session, f: dict, rid: int) -> dict:
        pools = self.tables.registry.stats()
        arenas = self.tables.handoffs.stats()
        growables = self.tables.growables.stats()
        for name, row in pools.items():
            row.update(arenas.get(name, {"arena_bytes": 0, "arena_free": 0}))
            row.update(growables.get(name, {"growables": 0, "growable_bytes": 0}))
        return {
            "backend": self.backend_name, "sessions": len(self.sessions), "pools": pools,
            "objects": len(self.tables.objects.objects), "pid": os.getpid(), "uptime": time.time() - self.started,
            "version": VERSION, "checkpoints": self.tables.checkpoints.stats(),
            "handoff": self.tables.directories.timing(),
        }

    def op_reset_high(self, session: Session, f: dict, rid: int) -> dict:
        reg = self.tables.registry
        for pool in [reg.pool(f["pool"])] if "pool" in f else reg.pools.values():
            pool.usage.reset_high()
        return {}

    def op_trim(self, session: Session, f: dict, rid: int) -> dict:
        self.tables.registry.pool(f["pool"]).usage.trim(f["keep"])
        return {}

    def op_set_release_threshold(self, session: Session, f: dict, rid: int) -> dict:
        self.tables.registry.pool(f["pool"]).usage.set_release_threshold(f["bytes"])
        return {}

    def op_bye(self, session: Session, f: dict, rid: int) -> dict:
        session.said_bye = True
        return {}

    def op_ping(self, session: Session, f: dict, rid: int) -> dict:
        return {}

    def op_ack(self, session: Session, f: dict, rid: int) -> dict:
        return {}   # its ``read`` was taken by the server

    # -- named objects ---------------------------------------------------------------------------
    def op_create(self, session: Session, f: dict, rid: int) -> dict:
        return self.create(session, Create(rid, f["pool"], f["name"], f["nbytes"], f.get("meta"), f.get("arena"),
                                           f.get("offset"), f.get("slot"), f.get("seq"), f.get("seal_credit")))

    def create(self, session: Session, c: Create) -> dict:
        """A create of either channel (a frame's comes here straight: ``Broker._on_frame``). Only
        the checks its directory entry needs come before ``ObjectTable.create`` writes it."""
        _, pool, name, nbytes, meta, aid, offset, slot, seq, promised = c
        handoffs = self.tables.handoffs
        arena = word = None
        if aid is not None or offset is not None:
            if aid is None or offset is None:
                raise InvalidRequest("create: arena and offset go together")
            arena = handoffs.own(session, aid)   # (looked up once for the word and the range)
        if slot is None and seq is None:
            if promised is not None:
                raise InvalidRequest("create: seal_credit goes with a seal-board slot")
            seq, promised = 0, b""
        else:
            if arena is None or slot is None or not seq:
                raise InvalidRequest("create: slot and a seq of at least 1 go with an arena range")
            word = handoffs.word(arena, slot, seq)
            promised = promised or b""
            self.tables.registry.pool(pool).ordering.check_promise(session.backend, promised)
        obj = self.tables.objects.create(session, name, nbytes, pool, meta or {}, arena, offset, word, seq, promised)
        return self._created(session, obj, pool, arena is not None)

    def create_usual(self, session: Session, data: bytes) -> tuple[int, dict] | None:
        """A create frame of the usual kind checked and entered in C (``ObjectTable.create_usual``):
        its request id and answer, as ``create``'s; None: not usual (``create`` does it)."""
        got = self.tables.objects.create_usual(session, data)
        return None if got is None else (got[0].rid, self._created(session, got[1], got[0].pool, True))

    def _created(self, session: Session, obj, pool: str, carved: bool) -> dict:
        """A new object's answer (``pool``: as the create named it), once readers already waiting
        watch its board word."""
        if obj.word is not None:   # readers already waiting watch the board from now on
            self.notices.pending(obj)
        if carved:   # the client has the memory already
            return Carved(obj.alloc.aid, pool, credit(obj.alloc.pool, session)).encode()
        return allocation(obj.alloc, credit=credit(obj.alloc.pool, session)).encode()

    def op_arena(self, session: Session, f: dict, rid: int) -> dict:
        arena = self.tables.handoffs.open(session, f["pool"], f["nbytes"])
        # A session carves from an arena with frames on its control socket (``ipcpool.frames``):
        # from now on each of its requests here first takes in the frames it sent before.
        session.framed = True
        credits = [arena.alloc.pool.ordering.credit(session.backend) for _ in range(ARENA_CREDITS)]
        a = arena.alloc
        return Arena(a.aid, a.pool.spec.name, a.export, tuple(c for c in credits if c), arena.words,
                     arena.first_seq).encode()

    def op_seal(self, session: Session, f: dict, rid: int) -> dict:
        obj = self.tables.objects.seal(session, f["name"], f.get("alloc"), f.get("done_event", b""))
        if obj is not None:   # (None: sealed from the board already, and told then)
            self.sealed(obj)
        return {}

    def sealed(self, obj) -> None:
        self.notices.sealed(obj)   # the readers waiting first: the rest is bookkeeping
        self.tables.durable.record_object(obj)

    def op_get(self, session: Session, f: dict, rid: int) -> dict | None:
        wake = f.get("wake")
        if wake is not None:   # a directory reader asleep: woken, it reads the directory (no lease here)
            now, obj = self.tables.objects.awake(f["name"], wake)
            if now:   # (it may be asleep on its directory already: a change it slept through)
                if obj is not None:
                    self.tables.directories.wake(obj.alloc.pool.spec.name)
                return {}
            timeout = f.get("timeout_ms")
            self.tables.objects.wait(session, f["name"], rid, None if timeout is None else timeout / 1000, wake)
            return None
        obj = self.tables.objects.lease(session, f["name"])
        if obj is not None:
            return lease(obj, credit(obj.alloc.pool, session)).encode()
        timeout = f.get("timeout_ms")
        if timeout != 0:
            obj = self.tables.objects.lease_pending(session, f["name"])
            if obj is not None:
                return pending(obj).encode()
        self.tables.objects.wait(session, f["name"], rid, None if timeout is None else timeout / 1000)
        return None

    def op_get_many(self, session: Session, f: dict, rid: int) -> dict:
        objs = self.tables.objects.lease_many(session, f["names"])
        allocs = [o.alloc for o in objs]
        pools = {a.pool for a in allocs}
        if len(pools) == 1:   # the usual batch: every object in one pool
            by_pool = {pools.pop(): [a.handle for a in allocs]}
        else:
            by_pool = {}
            for a in allocs:
                by_pool.setdefault(a.pool, []).append(a.handle)
        # One event per pool after all the seals, instead of one per object to open and wait on.
        joined = {pool: pool.ordering.join_seals(handles, session.backend) for pool, handles in by_pool.items()}
        return batch(objs, allocs, joined).encode()

    def op_delete(self, session: Session, f: dict, rid: int) -> dict:
        self._dropped(self.tables.objects.delete(session, f["name"]))
        return {}

    def _dropped(self, obj) -> None:
        """A deleted or abandoned object: forgotten; where it was never sealed, aborted."""
        self.tables.durable.forget_object(obj)
        if not obj.sealed:
            self.notices.aborted(obj, self.tables.objects.take_waiters(obj.name))

    def op_list(self, session: Session, f: dict, rid: int) -> dict:
        prefix, after, kind = f.get("prefix", ""), f.get("after", ""), f.get("kind")
        limit = min(f.get("limit") or protocol.LIST_PAGE, protocol.LIST_PAGE)
        objects, more_o, last_o = ([], False, "") if kind == "growables" else page(
            self.tables.objects.objects, prefix, after, limit, lambda o, h=self.tables.directories.hazards(): self.tables.objects.caught_up(o).info(h))
        growables, more_g, last_g = ([], False, "") if kind == "objects" else page(
            self.tables.growables.by_name, prefix, after, limit, lambda g: g.describe())
        return {"objects": objects, "growables": growables, "more": more_o or more_g,
                "after": last_g if kind == "growables" else last_o}

    def op_watch(self, session: Session, f: dict, rid: int) -> dict:
        w = self.tables.objects.watch(session, f["prefix"])
        if not f.get("existing"):
            return {"watch": w.wid, "existing": []}
        # The first page here; the client reads on with list(after=...) when ``more``.
        listed, more, last = page(self.tables.objects.objects, f["prefix"], "", protocol.LIST_PAGE, lambda o: o.info())
        return {"watch": w.wid, "existing": [o for o in listed if o["state"] == "sealed"], "more": more,
                "after": last}

    def op_unwatch(self, session: Session, f: dict, rid: int) -> dict:
        self.tables.objects.unwatch(session, f["watch"])
        return {}

    # -- growable buffers --------------------------------------------------------------------------
    # The four answered on the control socket (``broker.control``) give the state, which the
    # control socket sends with its FDs.
    def op_grow_create(self, session: Session, f: dict, rid: int) -> GrowableState:
        g = self.tables.growables.create(session, f["name"], f["nbytes"], f["pool"], f.get("compression", False))
        self.tables.durable.record_growable(g)
        return g.fields()

    def op_grow_attach(self, session: Session, f: dict, rid: int) -> GrowableState:
        return self.tables.growables.attach(session, f["name"]).fields()

    def op_grow(self, session: Session, f: dict, rid: int) -> GrowableState:
        g = self.tables.growables.attached(session, f["name"])
        gen = g.gen
        g, others, took = self.tables.growables.grow(session, f["name"], f["nbytes"], f.get("loan"), f.get("first"))
        if g.gen != gen:   # a grow to no more than the size changes nothing: nothing to record
            self.tables.durable.record_growable(g)   # only chunks not stored yet
            self.notices.grown(g, others)
        return g.state(took)

    def op_grow_sync(self, session: Session, f: dict, rid: int) -> GrowableState:
        """Control socket only: the buffer as it is now (the reply carries the FDs it lacks)."""
        return self.tables.growables.attached(session, f["name"]).fields()

    def op_grow_detach(self, session: Session, f: dict, rid: int) -> dict:
        self._forget_destroyed(self.tables.growables.detach(session, f["name"]))
        return {}

    def op_grow_delete(self, session: Session, f: dict, rid: int) -> dict:
        self._forget_destroyed(self.tables.growables.delete(f["name"]))
        return {}

    def _forget_destroyed(self, g) -> None:
        """A growable buffer whose memory went with the last holder: out of the FD store too."""
        if g is not None:
            self.tables.durable.forget_growable(g)

    # -- leases taken from a name directory (broker.directory) ------------------------------------
    def op_release(self, session: Session, f: dict, rid: int) -> dict:
        pool = self.tables.directories.release(session, f)
        # A credit for the reader's next release: recorded there instead of an IPC event made,
        # exported and opened per lease (and waited on by a stream of ours: R1's slow path).
        return Released(pool.spec.name, credit(pool, session)).encode()

    def op_dir_export(self, session: Session, f: dict, rid: int) -> dict:
        return allocation(self.tables.directories.export_of(session, f["pool"], f["alloc"])).encode()

    # -- who is connected --------------------------------------------------------------------------
    def op_sessions(self, session: Session, f: dict, rid: int) -> dict:
        """Open sessions of ids above ``after``, a page at most: who (pid, uid, gid) and what each
        keeps alive, so an operator can find the process behind the memory."""
        after = f.get("after", 0)
        shown = sorted((s for s in self.sessions.values() if s.sid > after), key=lambda s: s.sid)
        more = len(shown) > protocol.LIST_PAGE
        shown = shown[: protocol.LIST_PAGE]
        allocations = self.tables.registry.allocations
        objects = {o.alloc.aid: o for o in self.tables.objects.objects.values()}
        arenas: dict[Session, int] = {}
        for arena in self.tables.handoffs.arenas.values():
            if not arena.closed:
                arenas[arena.session] = arenas.get(arena.session, 0) + arena.alloc.size
        growables: dict[Session, int] = {}
        for g in self.tables.growables.by_name.values():
            for holder in g.holders:
                growables[holder] = growables.get(holder, 0) + 1
        rows = []
        for s in shown:
            held, leases, writing = arenas.get(s, 0), 0, 0
            for aid, n in s.held.items():
                alloc, obj = allocations.get(aid), objects.get(aid)
                if alloc is None:
                    continue
                lease = obj is not None and obj.writer is not s
                leases += n if lease else 0
                writing += obj is not None and not lease and not obj.sealed
                # A range carved from its own arena is in the arena's bytes already.
                held += alloc.size if alloc.charged or lease else 0
            rows.append({"session": s.sid, "pid": s.cred.pid, "uid": s.cred.uid, "gid": s.cred.gid,
                         "bytes": held, "arena_bytes": arenas.get(s, 0), "allocations": len(s.held),
                         "leases": leases, "writing": writing, "growables": growables.get(s, 0),
                         "state": "orphaned" if s.orphaned else "open"})
        return {"sessions": rows, "more": more}

    # -- checkpoints (``checkpoints``) --------------------------------------------------------------
    def op_ckpt_begin(self, session: Session, f: dict, rid: int) -> dict:
        made = self.tables.checkpoints.begin(session, f["name"], f["shards"], f["count"], f["pool"],
                                             f.get("user", {}), f.get("exclusive", False))
        if isinstance(made, Checkpoint):   # elected elsewhere: attach, or wait for the loader
            cur = made.current
            return {"busy": True, "current": cur.number if cur else None}
        shards = [allocation(a).encode() for a in made.shards]
        # A credit per shard for the writer's done events at publish (where the pool has them): the
        # seal then is the writer's own record of the broker's event, which readers wait on (one
        # GPU hop), not a wait of ours on the writer's event (~270 us on an H100) and a record after it.
        pool = made.shards[0].pool
        credits = [h for h in (pool.ordering.credit(session.backend) for _ in made.shards) if h]
        return {"version": made.number, "shards": shards,
                **({"pool": pool.spec.name, "credits": credits} if credits else {})}

    def op_ckpt_add(self, session: Session, f: dict, rid: int) -> dict:
        v = self.tables.checkpoints.add(session, f["name"], f["version"], f["entries"])
        return {"have": len(v.entries)}

    def op_ckpt_publish(self, session: Session, f: dict, rid: int) -> dict:
        v, old, spared = self.tables.checkpoints.publish(session, f["name"], f["version"], f.get("done_events", []),
                                                         f.get("keep", []))
        # ``spare``: the replaced version is the next one's memory (its writer may keep its mapping).
        return {"version": v.number, "replaced": old.number if old else None, "spare": spared}

    def op_ckpt_unkeep(self, session: Session, f: dict, rid: int) -> dict:
        """One way: the client unmapped shards it kept (``spares.Keeper``); ids it does not keep are ignored."""
        self.tables.checkpoints.spares.unkeep(session, f["allocs"])
        return {}

    def op_ckpt_abort(self, session: Session, f: dict, rid: int) -> dict:
        self.tables.checkpoints.abort(session, f["name"], f["version"])
        return {}

    def op_ckpt_attach(self, session: Session, f: dict, rid: int) -> dict:
        table = self.tables.checkpoints
        newer = f.get("newer_than")
        if newer is not None and "version" not in f:
            ckpt = table.checkpoints.get(f["name"])
            if ckpt is not None and ckpt.current is not None and ckpt.current.number <= newer:
                return {"same": True, "version": ckpt.current.number}
        v = table.attach(session, f["name"], f.get("version"))
        # The shards as a batch of leases (``Leases.adopt_batch`` imports them): one event per
        # pool after every shard's seal.
        shims = [_ShardLease(a) for a in v.shards]
        by_pool: dict = {}
        for a in v.shards:
            by_pool.setdefault(a.pool, []).append(a.handle)
        joined = {pool: pool.ordering.join_seals(handles, session.backend) for pool, handles in by_pool.items()}
        entries, more = _manifest_page(v.entries, 0)
        return {"version": v.number, "count": len(v.entries), "entries": entries, "more": more,
                "user": v.user, **batch(shims, list(v.shards), joined).encode()}

    def op_ckpt_manifest(self, session: Session, f: dict, rid: int) -> dict:
        v = self.tables.checkpoints.held(session, f["name"], f["version"])
        entries, more = _manifest_page(v.entries, f["start"])
        return {"entries": entries, "more": more}

    def op_ckpt_list(self, session: Session, f: dict, rid: int) -> dict:
        table = self.tables.checkpoints
        table.prune()
        limit = min(f.get("limit") or protocol.LIST_PAGE, protocol.LIST_PAGE)
        listed, more, last = page(table.checkpoints, f.get("prefix", ""), f.get("after", ""), limit, table.info)
        return {"checkpoints": listed, "more": more, "after": last}

    def op_ckpt_delete(self, session: Session, f: dict, rid: int) -> dict:
        self.tables.checkpoints.delete(f["name"])
        return {}


class _ShardLease:
    """What ``replies.batch`` reads of an object, for a shard (its metadata: none)."""

    __slots__ = ("alloc", "meta")

    def __init__(self, alloc):
        self.alloc, self.meta = alloc, {}


MANIFEST_PAGE_BYTES = 4 << 20   # of a reply's MAX_REPLY


def _manifest_page(entries: list, start: int) -> tuple[list, bool]:
    """Entries from ``start``: at most MAX_ARRAY (what a client unpacks) and about 4 MiB."""
    out, budget = [], MANIFEST_PAGE_BYTES
    for e in entries[start : start + protocol.MAX_ARRAY]:
        budget -= 40 + len(e[0]) + 9 * len(e[2])
        if budget < 0 and out:
            break
        out.append(e)
    return out, start + len(out) < len(entries)
