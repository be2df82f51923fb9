"""What each request on the message channel does: one method per op, found by name.

The server hands every validated request here; a method returns the reply's fields, or None when
the reply comes later (a ``get`` waiting for its seal is answered by ``_announce``).
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from .. import protocol
from .._version import __version__
from ..backend.base import Export
from ..errors import InvalidRequest
from .objects import NamedObject, abort_error
from .session import Session

if TYPE_CHECKING:
    from .server import Broker

VERSION = __version__
ARENA_CREDITS = 4   # events handed out with an arena: its first creates' seals need no wait


class Handlers:
    def __init__(self, broker: Broker):
        self.broker = broker
        self.registry = broker.registry
        self.objects = broker.objects
        self.growables = broker.growables

    def handle(self, session: Session, op: str, fields: dict, rid: int) -> dict | None:
        # validate() admits only known ops, and each has a method here (tests/unit checks both).
        return getattr(self, f"op_{op}")(session, fields, rid)

    # -- anonymous allocations -------------------------------------------------------------------
    def op_allocate(self, session: Session, f: dict, rid: int) -> dict:
        if "arena" in f or "offset" in f:   # carved by the client: it has the memory already
            if "arena" not in f or "offset" not in f:
                raise InvalidRequest("allocate: arena and offset go together")
            alloc = self.broker.handoffs.carve(session, f["arena"], f["offset"], f["nbytes"])
            return {"alloc": alloc.aid, "pool": f["pool"], **credit(alloc.pool, session)}
        alloc = self.registry.allocate(session, f["nbytes"], f["pool"])
        return {**export_fields(alloc), **credit(alloc.pool, session)}

    def op_free(self, session: Session, f: dict, rid: int) -> dict:
        if ("arena" in f) != ("offset" in f) or ("alloc" in f) == ("arena" in f):
            raise InvalidRequest("free names an allocation: alloc, or arena and offset")
        aid = f["alloc"] if "alloc" in f else self.broker.handoffs.carved(session, f["arena"], f["offset"])
        self.registry.free(session, aid, f.get("done_event", b""))
        return {}

    def op_share(self, session: Session, f: dict, rid: int) -> dict:
        return {"token": self.registry.share(session, f["alloc"])}

    def op_open(self, session: Session, f: dict, rid: int) -> dict:
        alloc = self.registry.open(session, f["token"])
        # A fresh ready event on the opener's stream: the one made at allocation may be recycled.
        return export_fields(alloc, alloc.pool.reexport(alloc.handle, alloc.export, session.backend))

    # -- pools and the session --------------------------------------------------------------------
    def op_stats(self, session: Session, f: dict, rid: int) -> dict:
        b = self.broker
        pools = self.registry.stats()
        arenas = b.handoffs.stats()
        growables = self.growables.stats()
        for name, row in pools.items():
            row.update(arenas.get(name, {"arena_bytes": 0, "arena_free": 0}))
            row.update(growables.get(name, {"growables": 0, "growable_bytes": 0}))
        return {
            "backend": b.choice.name, "sessions": len(b.sessions), "pools": pools,
            "objects": len(self.objects.objects), "pid": os.getpid(), "uptime": time.time() - b.started,
            "version": VERSION,
        }

    def op_reset_high(self, session: Session, f: dict, rid: int) -> dict:
        reg = self.registry
        for pool in [reg.pool(f["pool"])] if "pool" in f else reg.pools.values():
            pool.reset_high()
        return {}

    def op_trim(self, session: Session, f: dict, rid: int) -> dict:
        self.registry.pool(f["pool"]).trim(f["keep"])
        return {}

    def op_set_release_threshold(self, session: Session, f: dict, rid: int) -> dict:
        self.registry.pool(f["pool"]).set_release_threshold(f["bytes"])
        return {}

    def op_bye(self, session: Session, f: dict, rid: int) -> dict:
        session.said_bye = True
        return {}

    def op_ping(self, session: Session, f: dict, rid: int) -> dict:
        return {}

    # -- named objects ---------------------------------------------------------------------------
    def op_create(self, session: Session, f: dict, rid: int) -> dict:
        carve = board = None
        if "arena" in f or "offset" in f:
            if "arena" not in f or "offset" not in f:
                raise InvalidRequest("create: arena and offset go together")
            carve = lambda: self.broker.handoffs.carve(session, f["arena"], f["offset"], f["nbytes"])  # noqa: E731
        if "slot" in f or "seq" in f:
            if carve is None or "slot" not in f or not f.get("seq"):
                raise InvalidRequest("create: slot and a seq of at least 1 go with an arena range")
            word = self.broker.handoffs.word(session, f["arena"], f["slot"])
            promised = f.get("seal_credit", b"")
            self.registry.pool(f["pool"]).check_promise(session.backend, promised)
            board = (word, f["seq"], promised)
        elif "seal_credit" in f:
            raise InvalidRequest("create: seal_credit goes with a seal-board slot")
        obj = self.objects.create(session, f["name"], f["nbytes"], f["pool"], f.get("meta", {}), carve, board)
        if board is not None:   # readers already waiting watch the board from now on
            for w in self.objects.take_waiters(obj.name):
                if w.session.token in self.broker.sessions:
                    self.objects.lease_pending(w.session, obj.name)
                    self.broker.send(w.session.token, protocol.ok_reply(w.rid, **pending_fields(obj, w.session)))
        if carve is not None:   # the client has the memory already
            return {"alloc": obj.alloc.aid, "pool": f["pool"], **credit(obj.alloc.pool, session)}
        return {**export_fields(obj.alloc), **credit(obj.alloc.pool, session)}

    def op_arena(self, session: Session, f: dict, rid: int) -> dict:
        arena = self.broker.handoffs.open(session, f["pool"], f["nbytes"])
        credits = [arena.alloc.pool.credit(session.backend) for _ in range(ARENA_CREDITS)]
        return {**export_fields(arena.alloc), "credits": [c for c in credits if c], "words": arena.words}

    def op_seal(self, session: Session, f: dict, rid: int) -> dict:
        obj = self.objects.seal(session, f["name"], f.get("alloc"), f.get("done_event", b""))
        self._announce(obj)   # the readers waiting first: the rest is bookkeeping
        self.broker.durable.record_object(obj)
        return {}

    def op_get(self, session: Session, f: dict, rid: int) -> dict | None:
        obj = self.objects.lease(session, f["name"])
        if obj is not None:
            return {**lease_fields(obj), **credit(obj.alloc.pool, session)}
        timeout = f.get("timeout_ms")
        if timeout != 0:
            obj = self.objects.lease_pending(session, f["name"])
            if obj is not None:
                return pending_fields(obj, session)
        self.objects.wait(session, f["name"], rid, None if timeout is None else timeout / 1000)
        return None

    def op_get_many(self, session: Session, f: dict, rid: int) -> dict:
        objs = self.objects.lease_many(session, f["names"])
        by_pool: dict = {}
        for o in objs:
            by_pool.setdefault(o.alloc.pool, []).append(o.alloc.handle)
        # One event per pool after all the seals, instead of one per object to open and wait on.
        joined = {pool: pool.join_seals(handles, session.backend) for pool, handles in by_pool.items()}
        return batch_fields(objs, joined)

    def op_delete(self, session: Session, f: dict, rid: int) -> dict:
        obj = self.objects.delete(session, f["name"])
        self.broker.durable.forget_object(obj)
        if not obj.sealed:
            self.abandon(obj, self.objects.take_waiters(obj.name))
        return {}

    def op_list(self, session: Session, f: dict, rid: int) -> dict:
        prefix, after, kind = f.get("prefix", ""), f.get("after", ""), f.get("kind")
        limit = min(f.get("limit") or protocol.LIST_PAGE, protocol.LIST_PAGE)
        objects, more_o, last_o = ([], False, "") if kind == "growables" else page(
            self.objects.objects, prefix, after, limit, lambda o: o.info())
        growables, more_g, last_g = ([], False, "") if kind == "objects" else page(
            self.growables.by_name, prefix, after, limit, lambda g: g.describe())
        return {"objects": objects, "growables": growables, "more": more_o or more_g,
                "after": last_g if kind == "growables" else last_o}

    def op_watch(self, session: Session, f: dict, rid: int) -> dict:
        w = self.objects.watch(session, f["prefix"])
        if not f.get("existing"):
            return {"watch": w.wid, "existing": []}
        # The first page here; the client reads on with list(after=...) when ``more``.
        listed, more, last = page(self.objects.objects, f["prefix"], "", protocol.LIST_PAGE, lambda o: o.info())
        return {"watch": w.wid, "existing": [o for o in listed if o["state"] == "sealed"], "more": more,
                "after": last}

    def op_unwatch(self, session: Session, f: dict, rid: int) -> dict:
        self.objects.unwatch(session, f["watch"])
        return {}

    # -- growable buffers --------------------------------------------------------------------------
    def op_grow_create(self, session: Session, f: dict, rid: int) -> dict:
        g = self.growables.create(session, f["name"], f["nbytes"], f["pool"], f.get("compression", False))
        self.broker.durable.record_growable(g)
        return g.fields()

    def op_grow_attach(self, session: Session, f: dict, rid: int) -> dict:
        return self.growables.attach(session, f["name"]).fields()

    def op_grow(self, session: Session, f: dict, rid: int) -> dict:
        g, others = self.growables.grow(session, f["name"], f["nbytes"])
        self.broker.durable.record_growable(g)   # only chunks not stored yet
        if others:
            note = {"notify": "grown", "growable": g.name, "gen": g.gen, "size": g.memory.size}
            for other in others:
                self.broker.send(other.token, note)
        return g.fields()

    def op_grow_detach(self, session: Session, f: dict, rid: int) -> dict:
        self._released(self.growables.detach(session, f["name"]))
        return {}

    def op_grow_delete(self, session: Session, f: dict, rid: int) -> dict:
        self._released(self.growables.delete(f["name"]))
        return {}

    def _released(self, g) -> None:
        if g is not None:
            self.broker.durable.forget_growable(g)

    def _announce(self, obj: NamedObject) -> None:
        """A seal settles the gets waiting for it, tells pending readers (who may have seen it on
        the board already) and the watchers of its prefix."""
        if obj.pending:   # each with a credit for its release, kept off the pending answer's path
            note = {"notify": "sealed", "alloc": obj.alloc.aid, "event": ready_event(obj), "pool": obj.alloc.pool.spec.name}
            for reader in obj.pending:
                if reader.token in self.broker.sessions:
                    self.broker.send(reader.token, {**note, **credit(obj.alloc.pool, reader)})
            obj.pending = []
        for w in self.objects.take_waiters(obj.name):
            if w.session.token in self.broker.sessions:
                self.objects.lease(w.session, obj.name)
                fields = {**lease_fields(obj), **credit(obj.alloc.pool, w.session)}
                self.broker.send(w.session.token, protocol.ok_reply(w.rid, **fields))
        info = obj.info()
        for watch in self.objects.watchers(obj.name):
            self.broker.send(watch.session.token, {"notify": "sealed", "watch": watch.wid, "object": info})

    def abandon(self, obj: NamedObject, waiters: list) -> None:
        """An object that will never be sealed: its waiting gets fail, its pending readers are told
        (each still releases its lease, as for any)."""
        for w in waiters:
            self.broker.send(w.session.token, protocol.error_reply(w.rid, abort_error(obj.name)))
        for reader in obj.pending:
            if reader.token in self.broker.sessions:
                self.broker.send(reader.token, {"notify": "aborted", "alloc": obj.alloc.aid, "name": obj.name})
        obj.pending = []


def page(table: dict, prefix: str, after: str, limit: int, describe) -> tuple[list[dict], bool, str]:
    """Entries of ``table`` (name -> item) under ``prefix`` whose names sort after ``after``, in
    name order: at most ``limit`` and at most half a reply's bytes. Returns (entries, more, the last
    name taken: where the next page starts)."""
    names = sorted(n for n in table if n > after and n.startswith(prefix))
    out: list[dict] = []
    budget = protocol.MAX_REPLY // 2
    for name in names:
        if len(out) >= limit:
            break
        entry = describe(table[name])
        budget -= len(protocol.pack(entry))
        if budget < 0 and out:
            break
        out.append(entry)
    return out, len(out) < len(names), out[-1]["name"] if out else after


def credit(pool, session: Session) -> dict:
    """An event of the broker's for the client's next done event on ``pool`` (see
    ``BrokerPool.credit``): a reply that hands out memory brings one for its release."""
    handle = pool.credit(session.backend)
    return {"credit": handle} if handle else {}


def export_fields(alloc, export: Export | None = None) -> dict:
    e = export or alloc.export
    return {
        "alloc": alloc.aid, "pool": alloc.pool.spec.name, "size": e.size, "offset": e.offset,
        "data": e.data, "event": e.ready_event, "sub": e.sub, "chunks": list(e.chunks),
    }


def batch_fields(objs: list[NamedObject], joined: dict) -> dict:
    """A batch of leases as columns (one entry per object, in order), each pool, event and export
    data sent once: a thousand leases pack and unpack several times faster than a thousand maps."""
    pools = list(joined)
    pool_index = {p: i for i, p in enumerate(pools)}
    datas: dict[bytes, int] = {}
    cols: dict[str, list] = {k: [] for k in ("alloc", "pool", "size", "offset", "data", "sub", "chunks", "meta")}
    for o in objs:
        e = o.alloc.export
        cols["alloc"].append(o.alloc.aid)
        cols["pool"].append(pool_index[o.alloc.pool])
        cols["size"].append(e.size)
        cols["offset"].append(e.offset)
        cols["data"].append(datas.setdefault(e.data, len(datas)))
        cols["sub"].append(e.sub)
        cols["chunks"].append(list(e.chunks))
        cols["meta"].append(o.meta)
    return {"pools": [p.spec.name for p in pools], "events": [joined[p] for p in pools],
            "datas": list(datas), **cols}


def ready_event(obj: NamedObject) -> bytes:
    """The event a reader of a sealed object orders its work after; empty once the broker has
    seen it complete (the reader then opens nothing, R1)."""
    return b"" if obj.alloc.pool.seal_done(obj.alloc.handle) else obj.seal_event


def lease_fields(obj: NamedObject, event: bytes | None = None) -> dict:
    """A lease: the object's export with the event readers wait on (its seal, or a batch's)."""
    e = obj.alloc.export
    ready = ready_event(obj) if event is None else event
    lease = Export(size=e.size, offset=e.offset, data=e.data, ready_event=ready, sub=e.sub, chunks=e.chunks)
    return {**export_fields(obj.alloc, lease), "name": obj.name, "meta": obj.meta}


def pending_fields(obj: NamedObject, session: Session) -> dict:
    """A lease on an object still being written: the reader watches board word ``word`` until it
    holds ``seq``, then orders its work after the promised event. (Its credit comes with the seal's
    notice: making an IPC event here would delay the answer the reader is waiting for.)"""
    return {**lease_fields(obj, obj.promised), "pending": True, "word": obj.word, "seq": obj.seq}
