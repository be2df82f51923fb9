"""The fields of the broker's replies and notices that hand out memory: exports, leases, credits,
batches of leases, and pages of listings; and what an unexpected failure becomes in a reply."""

from __future__ import annotations

import logging

from .. import protocol
from ..backend.base import BrokerBackend, Export
from ..errors import InternalError, IpcPoolError
from .objects import NamedObject
from .session import Session

log = logging.getLogger("ipcpool.broker")


def unexpected(backend: BrokerBackend, exc: Exception, who: str) -> IpcPoolError:
    """A failure that is not an ipcpool error, on either channel: the backend's own (a CUDA driver
    error, say) as the backend's error, anything else as a broker bug, logged with its traceback."""
    err = backend.foreign_error(exc)
    if err is None:
        log.exception("%s: internal error handling a request", who)
        return InternalError.of(exc)
    log.error("%s: request failed in the %s backend: %s", who, backend.name, err)
    return err


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
    ``Ordering.credit``): a reply that hands out memory brings one for the free that ends it."""
    handle = pool.ordering.credit(session.backend)
    return {"credit": handle} if handle else {}


def export_fields(alloc, export: Export | None = None) -> dict:
    e = export or alloc.export
    return {
        "alloc": alloc.aid, "pool": alloc.pool.spec.name, "size": e.size, "offset": e.offset,
        "data": e.data, "event": e.ready_event, "sub": e.sub, "chunks": list(e.chunks),
    }


def batch_fields(objs: list[NamedObject], allocs: list, joined: dict) -> dict:
    """A batch of leases as columns (one entry per object, in order; ``allocs`` their
    allocations), each pool, event and export data sent once: a thousand leases pack and unpack
    several times faster than a thousand maps. A column is one pass over the batch."""
    pools = list(joined)
    exports = [a.export for a in allocs]
    if len(pools) == 1:
        pool_col = [0] * len(allocs)
    else:
        pool_index = {p: i for i, p in enumerate(pools)}
        pool_col = [pool_index[a.pool] for a in allocs]
    datas: dict[bytes, int] = {}
    index = datas.setdefault
    return {"pools": [p.spec.name for p in pools], "events": [joined[p] for p in pools],
            "alloc": [a.aid for a in allocs], "pool": pool_col,
            "size": [e.size for e in exports], "offset": [e.offset for e in exports],
            "data": [index(e.data, len(datas)) for e in exports], "datas": list(datas),
            "sub": [e.sub for e in exports], "chunks": [e.chunks for e in exports],   # (tuples pack as arrays)
            "meta": [o.meta for o in objs]}


def ready_event(obj: NamedObject) -> bytes:
    """The event a reader of a sealed object orders its work after; empty once the broker has
    seen it complete (the reader then opens nothing, R1)."""
    return b"" if obj.alloc.pool.ordering.seal_done(obj.alloc.handle) else obj.seal_event


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
