"""The broker's replies that hand out memory, made from its objects (``ipcpool.replies`` has their
fields): exports, leases, credits, batches of leases; pages of listings; and what an unexpected
failure becomes in a reply."""

from __future__ import annotations

import logging

from .. import protocol
from ..backend.base import BrokerBackend, Export
from ..errors import InternalError, IpcPoolError
from ..replies import Allocation, Batch, Lease
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


def credit(pool, session: Session) -> bytes:
    """An event of the broker's for the client's next done event on ``pool`` (see
    ``Ordering.credit``): a reply that hands out memory brings one for the free that ends it."""
    return pool.ordering.credit(session.backend) or b""


def allocation(alloc, export: Export | None = None, credit: bytes = b"") -> Allocation:
    return Allocation(alloc.aid, alloc.pool.spec.name, export or alloc.export, credit)


def batch(objs: list[NamedObject], allocs: list, joined: dict) -> Batch:
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
    return Batch(pools=[p.spec.name for p in pools], events=[joined[p] for p in pools],
                 alloc=[a.aid for a in allocs], pool=pool_col,
                 size=[e.size for e in exports], offset=[e.offset for e in exports],
                 data=[index(e.data, len(datas)) for e in exports], datas=list(datas),
                 sub=[e.sub for e in exports], chunks=[e.chunks for e in exports],   # (tuples pack as arrays)
                 meta=[o.meta for o in objs])


def ready_event(obj: NamedObject) -> bytes:
    """The event a reader of a sealed object orders its work after; empty once the broker has
    seen it complete (the reader then opens nothing, R1)."""
    return b"" if obj.alloc.pool.ordering.seal_done(obj.alloc.handle) else obj.seal_event


def lease(obj: NamedObject, credit: bytes = b"") -> Lease:
    """A lease on a sealed object: its export with the event readers wait on."""
    e = obj.alloc.export
    export = Export(size=e.size, offset=e.offset, data=e.data, ready_event=ready_event(obj), sub=e.sub, chunks=e.chunks)
    return Lease(obj.alloc.aid, obj.alloc.pool.spec.name, export, obj.name, obj.meta, credit)


def pending(obj: NamedObject) -> Lease:
    """A lease on an object still being written: the reader watches board word ``word`` until it
    holds ``seq``, then orders its work after the promised event. (Its credit comes with the seal's
    notice: making an IPC event here would delay the answer the reader is waiting for.)"""
    e = obj.alloc.export
    export = Export(size=e.size, offset=e.offset, data=e.data, ready_event=obj.promised, sub=e.sub, chunks=e.chunks)
    return Lease(obj.alloc.aid, obj.alloc.pool.spec.name, export, obj.name, obj.meta,
                 pending=True, word=obj.word, seq=obj.seq)
