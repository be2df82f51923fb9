"""The fields of the broker's replies and notices that hand out memory: exports, leases, credits,
batches of leases, and pages of listings."""

from __future__ import annotations

from .. import protocol
from ..backend.base import Export
from .objects import NamedObject
from .session import Session


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
    ``BrokerPool.credit``): a reply that hands out memory brings one for the free that ends it."""
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
