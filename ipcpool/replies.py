"""The broker's replies and notices, as records: each one's fields are written here and nowhere else.

The broker makes a record and sends ``encode()`` (a plain map, packed as any message); the client
reads one with ``Record.decode(msg)``. The maps and their field names are the wire's, unchanged
since replies were built by hand, so old clients and raw readers see the same messages.

Decoding is a constructor call and nothing more: replies of the hand-off arrive microseconds apart
and a validation layer would cost more than their fields. Where a field needs checking (a hello,
a notice's numbers) the reader that uses it checks it, or ``decode`` says so. Replies not listed
here (stats, listings, sessions, checkpoints' manifests) stay maps: they are read once, by the
code that shows them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .backend.records import Export
from .errors import ProtocolError


def _export_fields(alloc: int, pool: str, e: Export) -> dict:
    return {"alloc": alloc, "pool": pool, "size": e.size, "offset": e.offset, "data": e.data,
            "event": e.ready_event, "sub": e.sub, "chunks": list(e.chunks)}


def _export(m: dict) -> Export:
    return Export(m["size"], m["offset"], m["data"], m["event"], bool(m.get("sub")), tuple(m.get("chunks") or ()))


def credits_of(msg: dict) -> tuple[str, list[bytes]] | None:
    """The broker's events a reply or notice brings (``credit``: one, for the done event that ends
    the memory it hands out; an arena's ``credits``), with their pool; None where it brings none."""
    if "credit" in msg:
        got = [msg["credit"]]
    elif "credits" in msg:
        got = list(msg["credits"] or ())
    else:
        return None
    pool = msg.get("pool")
    return (pool, got) if isinstance(pool, str) else None


# -- memory handed out ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Allocation:
    """Memory handed out with its export: allocate, open, create (not carved), dir_export, each
    shard of a checkpoint's begin. ``credit``: an event of the broker's for the done event that
    ends it (CUDA; empty where none)."""

    alloc: int
    pool: str
    export: Export
    credit: bytes = b""

    def encode(self) -> dict:
        out = _export_fields(self.alloc, self.pool, self.export)
        if self.credit:
            out["credit"] = self.credit
        return out

    @classmethod
    def decode(cls, m: dict) -> Allocation:
        return cls(m["alloc"], m["pool"], _export(m), m.get("credit", b""))


@dataclass(frozen=True, slots=True)
class Arena:
    """An arena (``op_arena``): its allocation, the credits its first creates' seals go on, and
    its block of board words (None: it has none)."""

    alloc: int
    pool: str
    export: Export
    credits: tuple[bytes, ...] = ()
    words: int | None = None
    first_seq: int = 1   # where its objects' numbers start (``sealboard.Blocks``)

    def encode(self) -> dict:
        return {**_export_fields(self.alloc, self.pool, self.export), "credits": list(self.credits),
                "words": self.words, "first_seq": self.first_seq}

    @classmethod
    def decode(cls, m: dict) -> Arena:
        return cls(m["alloc"], m["pool"], _export(m), tuple(m.get("credits") or ()), m.get("words"),
                   m.get("first_seq", 1))


@dataclass(frozen=True, slots=True)
class Carved:
    """The answer to a create or allocate carved by the client (it has the memory already)."""

    alloc: int
    pool: str
    credit: bytes = b""

    def encode(self) -> dict:
        return {"alloc": self.alloc, "pool": self.pool, **({"credit": self.credit} if self.credit else {})}

    @classmethod
    def decode(cls, m: dict) -> Carved:
        return cls(m["alloc"], m["pool"], m.get("credit", b""))


@dataclass(frozen=True, slots=True)
class Lease:
    """A read lease (``get``): the object's export with the event its readers wait on, its name
    and metadata. *Pending* (answered before the seal): the reader watches board word ``word``
    until it holds ``seq``, and the event is the one the writer promised to record its seal on."""

    alloc: int
    pool: str
    export: Export
    name: str
    meta: dict
    credit: bytes = b""
    pending: bool = False
    word: int | None = None
    seq: int | None = None

    def encode(self) -> dict:
        out = {**_export_fields(self.alloc, self.pool, self.export), "name": self.name, "meta": self.meta}
        if self.pending:
            out.update(pending=True, word=self.word, seq=self.seq)
        if self.credit:
            out["credit"] = self.credit
        return out

    @classmethod
    def decode(cls, m: dict) -> Lease:
        return cls(m["alloc"], m["pool"], _export(m), m.get("name", ""), m.get("meta") or {},
                   m.get("credit", b""), bool(m.get("pending")), m.get("word"), m.get("seq"))


@dataclass(frozen=True, slots=True)
class Batch:
    """A batch of leases as columns, one entry per object (``get_many``, a checkpoint's attach);
    each pool, its event and each export's data sent once: ``pool`` and ``data`` index ``pools``
    (and ``events``) and ``datas``. A thousand leases pack and unpack several times faster so."""

    pools: list[str]
    events: list[bytes]
    alloc: list[int]
    pool: list[int]
    size: list[int]
    offset: list[int]
    data: list[int]
    datas: list[bytes]
    sub: list[bool]
    chunks: list
    meta: list[dict]

    def encode(self) -> dict:
        return {"pools": self.pools, "events": self.events, "alloc": self.alloc, "pool": self.pool,
                "size": self.size, "offset": self.offset, "data": self.data, "datas": self.datas,
                "sub": self.sub, "chunks": self.chunks, "meta": self.meta}

    @classmethod
    def decode(cls, m: dict) -> Batch:
        g = m.get
        return cls(m["pools"], m["events"], g("alloc", ()), g("pool", ()), g("size", ()), g("offset", ()),
                   g("data", ()), m["datas"], g("sub", ()), g("chunks", ()), g("meta", ()))

    def columns(self) -> tuple:
        """The per-object columns, in the order ``Leases.adopt_batch`` reads them."""
        return self.alloc, self.pool, self.size, self.offset, self.data, self.sub, self.chunks, self.meta


@dataclass(frozen=True, slots=True)
class Released:
    """The answer to a directory lease's release: a credit for the reader's next one."""

    pool: str
    credit: bytes = b""

    def encode(self) -> dict:
        return {"pool": self.pool, **({"credit": self.credit} if self.credit else {})}


@dataclass(frozen=True, slots=True)
class Shared:
    """The token another session opens a shared allocation with."""

    token: bytes

    def encode(self) -> dict:
        return {"token": self.token}

    @classmethod
    def decode(cls, m: dict) -> Shared:
        return cls(m["token"])


# -- the control socket ----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Hello:
    """The answer to a hello: the session, its token (the DEALER's routing id), the message
    channel's endpoint, the pools it may use and each one's device."""

    token: bytes
    session: int
    backend: str
    endpoint: str
    version: int
    pools: tuple[str, ...]
    devices: dict[str, int]

    def encode(self) -> dict:
        return {"token": self.token, "session": self.session, "backend": self.backend, "endpoint": self.endpoint,
                "version": self.version, "pools": list(self.pools), "devices": self.devices}

    @classmethod
    def decode(cls, m: dict) -> Hello:
        """Checked field by field (once a session): a ProtocolError names what is missing."""
        for key, kind in (("token", bytes), ("session", int), ("backend", str), ("endpoint", str), ("pools", list)):
            if not isinstance(m.get(key), kind):
                raise ProtocolError(f"hello reply lacks {key!r}")
        devices = m.get("devices")   # each pool's device (a growable's mapping is made ahead)
        devices = {k: v for k, v in devices.items() if isinstance(k, str) and isinstance(v, int)
                   and not isinstance(v, bool)} if isinstance(devices, dict) else {}
        return cls(m["token"], m["session"], m["backend"], m["endpoint"], m.get("version", 0), tuple(m["pools"]),
                   devices)


@dataclass(frozen=True, slots=True)
class PoolFds:
    """What comes with a pool's FDs (``pool_fd``): the pool's info, its seal board (always), its
    name directory's capacity and index in lease slots where it has one, and ``lease_page`` with
    the session's first (its FD last)."""

    info: Any
    directory: int | None = None
    pool_index: int | None = None
    lease_page: bool = False

    def encode(self) -> dict:
        out = {"info": self.info}
        if self.directory is not None:
            out.update(directory=self.directory, pool_index=self.pool_index)
        if self.lease_page:
            out["lease_page"] = True
        return out

    @classmethod
    def decode(cls, m: dict) -> PoolFds:
        directory = m.get("directory")
        return cls(m.get("info"), directory if isinstance(directory, int) else None, m.get("pool_index"),
                   bool(m.get("lease_page")))

    @property
    def fds(self) -> int:
        """How many FDs the reply carries: the pool's, its board's, its directory's, a lease page's."""
        return 2 + (self.directory is not None) + self.lease_page


@dataclass(frozen=True, slots=True)
class ChunkFds:
    """A batch of chunk FDs (``chunk_fds``): the sizes of the chunks they map."""

    chunks: list[int]

    def encode(self) -> dict:
        return {"chunks": self.chunks}

    @classmethod
    def decode(cls, m: dict) -> ChunkFds:
        return cls(list(m.get("chunks") or ()))


@dataclass(frozen=True, slots=True)
class AllocFds:
    """The chunk FDs of several allocations (``alloc_fds``): how many each has, in order."""

    counts: list[int]

    def encode(self) -> dict:
        return {"counts": self.counts}

    @classmethod
    def decode(cls, m: dict) -> AllocFds:
        return cls(list(m.get("counts") or ()))


@dataclass(frozen=True, slots=True)
class GrowableState:
    """A growable buffer as a reply on the control socket says it is: its size, chunks and
    generation, its word on the growth board and the stamp it holds. Create, attach and sync
    add what mapping it needs (``pool``, ``info``, ``compression_requested``); a grow says whether
    it ``took`` the client's loan. As sent: ``board`` (the growth board's FD comes first),
    ``batch`` (the sizes of the chunks whose FDs follow) and ``lend`` (chunks lent, ``[[id,
    size], ...]``, their FDs last)."""

    name: str
    size: int
    chunks: list[int]
    gen: int
    word: int = -1
    stamp: int | None = None
    pool: str | None = None
    info: dict | None = None
    compression_requested: bool | None = None
    took: bool | None = None
    board: bool = False
    lend: list | None = None
    batch: list[int] | None = None

    def as_sent(self, board: bool, batch: list[int], lend: list | None, pool: str | None, info: dict | None) -> GrowableState:
        """This state with what its FDs are (``broker.control``); ``pool`` and ``info`` where it had none."""
        return GrowableState(self.name, self.size, self.chunks, self.gen, self.word, self.stamp, self.pool or pool,
                             self.info or info, self.compression_requested, self.took, board, lend, batch)

    def encode(self) -> dict:
        out = {"name": self.name, "size": self.size, "chunks": self.chunks, "gen": self.gen, "word": self.word,
               "stamp": self.stamp}
        if self.pool is not None:
            out["pool"] = self.pool
        if self.info is not None:
            out["info"] = self.info
        if self.compression_requested is not None:
            out["compression_requested"] = self.compression_requested
        if self.took is not None:
            out["took"] = self.took
        if self.board:
            out["board"] = True
        if self.lend is not None:
            out["lend"] = self.lend
        if self.batch is not None:
            out["batch"] = self.batch
        return out

    @classmethod
    def decode(cls, m: dict) -> GrowableState:
        g = m.get
        info = g("info")
        return cls(m["name"], m["size"], m["chunks"], m["gen"], g("word", -1), g("stamp"), g("pool"),
                   info if isinstance(info, dict) else None, g("compression_requested"), g("took"),
                   g("board") is True, g("lend"), g("batch"))


# -- notices: what the broker sends unasked --------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SealNotice:
    """An object a pending lease waits for was sealed: the event to order after (empty: complete
    already), and a credit for the free of the lease."""

    alloc: int
    event: bytes
    pool: str
    credit: bytes = b""

    def encode(self) -> dict:
        out = {"notify": "sealed", "alloc": self.alloc, "event": self.event, "pool": self.pool}
        if self.credit:
            out["credit"] = self.credit
        return out

    @classmethod
    def decode(cls, m: dict) -> SealNotice:
        event = m.get("event", b"")
        return cls(m["alloc"], event if isinstance(event, bytes) else b"", m.get("pool", ""), m.get("credit", b""))


@dataclass(frozen=True, slots=True)
class AbortNotice:
    """An object a pending lease waits for will never be sealed."""

    alloc: int
    name: str

    def encode(self) -> dict:
        return {"notify": "aborted", "alloc": self.alloc, "name": self.name}

    @classmethod
    def decode(cls, m: dict) -> AbortNotice:
        return cls(m["alloc"], m.get("name", ""))


@dataclass(frozen=True, slots=True)
class ReclaimNotice:
    """A range a session carved from its arena is idle again (every reader's done event has
    completed): the arena may carve it anew."""

    arena: Any
    offset: Any

    def encode(self) -> dict:
        return {"notify": "reclaim", "arena": self.arena, "offset": self.offset}

    @classmethod
    def decode(cls, m: dict) -> ReclaimNotice:
        return cls(m.get("arena"), m.get("offset"))


@dataclass(frozen=True, slots=True)
class WatchNotice:
    """A seal under a watched prefix: the object as a listing shows it (one notice per session)."""

    watch: int
    object: dict

    def encode(self) -> dict:
        return {"notify": "sealed", "watch": self.watch, "object": self.object}

    @classmethod
    def decode(cls, m: dict) -> WatchNotice:
        return cls(m.get("watch"), m.get("object"))


@dataclass(frozen=True, slots=True)
class GrowNotice:
    """Another session grew a growable buffer this one holds: the state it grew to (numbers
    unchecked here: ``Growables.on_grown`` takes only ints)."""

    growable: Any
    gen: Any
    size: Any
    chunks: Any   # how many

    def encode(self) -> dict:
        return {"notify": "grown", "growable": self.growable, "gen": self.gen, "size": self.size, "chunks": self.chunks}

    @classmethod
    def decode(cls, m: dict) -> GrowNotice:
        return cls(m.get("growable"), m.get("gen"), m.get("size"), m.get("chunks"))
