"""Broker memory that outlives the broker: pool FDs and a metadata memfd in systemd's FD store.

At start the broker stores each durable pool's FD (FDSTORE=1, FDNAME=pool-<name>) and a memfd
holding the table of sealed objects and growable buffers (FDNAME=meta; systemd holds the same open
file). The table is a snapshot followed by one small record per change (an object sealed or
deleted, a growable made, grown or destroyed), appended in place: a seal costs one row, whatever
the number of objects. Once the records outgrow the snapshot, a fresh snapshot replaces them all. A growable buffer's FDs are stored as it is
created and grown (FDNAME=grow-<id>-<n>), a sealed object's VMM chunks as it is sealed
(FDNAME=vmm-<key>-<n>); they are removed when the memory goes. A broker started with those FDs
($LISTEN_FDS, $LISTEN_FDNAMES, $LISTEN_PID) restores the pools and growables and re-creates the sealed
objects where they were: a crash or an upgrade loses no weights.

A CUDA pool comes back as an imported pool, which holds its memory but cannot allocate: it is kept
read-only as ``<name>~<n>`` (stored under that name from then on) for the objects restored in it,
beside a fresh pool for new memory, and closed once its last restored object is gone. Anonymous allocations and unsealed objects
belong to sessions, which a restart ends, so they are not kept.
"""

from __future__ import annotations

import logging
import os
import secrets

import msgpack

from .systemd import Notifier

log = logging.getLogger(__name__)

LISTEN_FDS_START = 3
META_NAME = "meta"
META_VERSION = 2          # a snapshot map, then change records ({"+o": row}, {"-o": name}, ...)
READABLE = (1, 2)         # version 1: the snapshot alone
COMPACT_MIN = 64 << 10    # records may grow to this many bytes, or twice the snapshot, before one


def listen_fds(environ: dict[str, str] | None = None) -> dict[str, int]:
    """FDs passed by systemd (sd_listen_fds_with_names), by name; the variables are unset so
    that children do not see them."""
    env = os.environ if environ is None else environ
    if env.get("LISTEN_PID") != str(os.getpid()):
        if env.get("LISTEN_FDS"):
            log.warning("ignoring LISTEN_FDS: LISTEN_PID=%s is not this process (%d)", env.get("LISTEN_PID"), os.getpid())
        return {}
    try:
        count = int(env.get("LISTEN_FDS", "0"))
    except ValueError:
        return {}
    names = env.get("LISTEN_FDNAMES", "").split(":") if env.get("LISTEN_FDNAMES") else []
    for key in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        env.pop(key, None)
    fds = {}
    for i in range(count):
        fd = LISTEN_FDS_START + i
        os.set_inheritable(fd, False)
        name = names[i] if i < len(names) else f"unnamed{i}"
        if name in fds:   # the store may hold duplicates of a name: keep the first, close the rest
            os.close(fd)
            continue
        fds[name] = fd
    return fds


class Durability:
    def __init__(self, notifier: Notifier, inherited: dict[str, int] | None = None):
        self.notifier = notifier
        self.inherited = listen_fds() if inherited is None else inherited
        self._meta_fd = self.inherited.pop(META_NAME, None)
        self._objects = self._growables = None
        self._table_read: dict | None = None
        self._pools: dict = {}
        self._taken: list[str] = []   # pool FD names restored: stored again, maybe as another pool
        self._snapshot = self._end = 0   # bytes of the table's snapshot, and where records end
        if self._meta_fd is not None:
            log.info("adopting %d FD(s) from the FD store", len(self.inherited) + 1)

    @property
    def enabled(self) -> bool:
        return self.notifier.enabled

    # -- what a previous broker left -------------------------------------------------------------
    def _table(self) -> dict:
        """The stored table, read once (empty on a fresh start or when unreadable)."""
        if self._table_read is None:
            self._table_read = {}
            if self._meta_fd is not None:
                try:
                    size = os.fstat(self._meta_fd).st_size
                    table = replay(os.pread(self._meta_fd, size, 0)) if size else {}
                except (OSError, ValueError, TypeError, KeyError, msgpack.UnpackException) as exc:
                    log.error("the stored object table is unreadable (%s); starting without it", exc)
                    table = {}
                self._table_read = table
        return self._table_read

    def stored_objects(self) -> list[dict]:
        """The sealed objects a previous broker recorded."""
        return list(self._table().get("objects", []))

    def stored_growables(self) -> list[dict]:
        return list(self._table().get("growables", []))

    def pool_info(self, name: str) -> dict:
        info = self._table().get("pools", {}).get(name, {})
        return info if isinstance(info, dict) else {}

    def take_pool_fd(self, name: str) -> int | None:
        fd = self.inherited.pop(f"pool-{name}", None)   # FDNAME allows no colon
        if fd is not None:
            self._taken.append(f"pool-{name}")
        return fd

    def older_pools(self) -> list[tuple[str, int]]:
        """Read-only pool generations (``<name>~<n>``) restored by earlier restarts, taken."""
        names = [k for k in self.inherited if k.startswith("pool-") and "~" in k]
        self._taken += names
        return [(k.removeprefix("pool-"), self.inherited.pop(k)) for k in names]

    def _take(self, prefix: str, count: int) -> list[int] | None:
        names = [f"{prefix}-{i}" for i in range(count)]
        if not all(n in self.inherited for n in names):
            return None
        return [self.inherited.pop(n) for n in names]

    def take_growable_fds(self, gid: int, count: int) -> list[int] | None:
        """A stored growable's FDs, or None (and none taken) if any is missing."""
        return self._take(f"grow-{gid}", count)

    def take_object_fds(self, key: str, count: int) -> list[int] | None:
        """The chunk FDs of a stored VMM-backed object, or None (and none taken) if any is missing."""
        return self._take(f"vmm-{key}", count)

    # -- handing ours to systemd -------------------------------------------------------------------
    def store(self, registry) -> None:
        """Hand the pools' FDs and the table's memfd to systemd. What the previous broker stored and
        this one did not restore is removed; a pool restored read-only moves to its new name."""
        for name in list(self.inherited):
            os.close(self.inherited.pop(name))
            self.notifier.notify("FDSTOREREMOVE=1", f"FDNAME={name}")
        if not self.enabled:
            return
        for name in self._taken:   # systemd removes by name: the name may now be a fresh pool's
            self.notifier.notify("FDSTOREREMOVE=1", f"FDNAME={name}")
        for name, pool in registry.pools.items():
            self.notifier.notify("FDSTORE=1", f"FDNAME=pool-{name}", fds=(pool.fd,))
        if self._meta_fd is None:
            self._meta_fd = os.memfd_create("ipcpool:meta", os.MFD_CLOEXEC)
        self.notifier.notify("FDSTORE=1", f"FDNAME={META_NAME}", fds=(self._meta_fd,))
        self._pools = registry.pools

    def unstore_pool(self, pool) -> None:
        if self.enabled:
            self.notifier.notify("FDSTOREREMOVE=1", f"FDNAME=pool-{pool.spec.name}")

    def _store_all(self, prefix: str, fds: list[int], first: int = 0) -> None:
        if self.enabled:
            for i in range(first, len(fds)):
                self.notifier.notify("FDSTORE=1", f"FDNAME={prefix}-{i}", fds=(fds[i],))

    def _unstore_all(self, prefix: str, count: int) -> None:
        if self.enabled:
            for i in range(count):
                self.notifier.notify("FDSTOREREMOVE=1", f"FDNAME={prefix}-{i}")

    def record_object(self, obj) -> None:
        """A sealed object: its chunk FDs (if any) to the store, its row to the table."""
        if not _restorable(obj):
            return
        self.store_object(obj)
        self._append({"+o": self._object_row(obj)})

    def forget_object(self, obj) -> None:
        self.unstore_object(obj)
        if obj.sealed:
            self._append({"-o": obj.name})

    def record_growable(self, g) -> None:
        """A growable made or grown: its new chunk FDs to the store, its row (again) to the table."""
        if not self.enabled and self._meta_fd is None:   # nothing kept: no row built per grow
            return
        self.store_growable(g)
        self._append({"+g": self._growable_row(g)})

    def forget_growable(self, g) -> None:
        if g.stored:
            self.unstore_growable(g)
            self._append({"-g": g.gid})

    def store_object(self, obj) -> None:
        """A sealed object whose memory is VMM chunks: their FDs go to the store under a key of
        its own (its pool's FD covers every other object)."""
        fds = obj.alloc.pool.chunk_fds(obj.alloc.handle)
        if fds:
            obj.fdkey = obj.fdkey or secrets.token_hex(6)
            self._store_all(f"vmm-{obj.fdkey}", fds)

    def unstore_object(self, obj) -> None:
        if obj.fdkey:
            self._unstore_all(f"vmm-{obj.fdkey}", len(obj.alloc.export.chunks))

    def store_growable(self, g) -> None:
        """Hand systemd the growable's FDs it does not hold yet (new chunks)."""
        fds = g.memory.fds(0)
        self._store_all(f"grow-{g.gid}", fds, g.stored)
        g.stored = len(fds)

    def unstore_growable(self, g) -> None:
        self._unstore_all(f"grow-{g.gid}", g.stored)
        g.stored = 0

    def tables(self, objects, growables) -> None:
        """The tables ``save`` records."""
        self._objects, self._growables = objects, growables

    def save(self) -> None:
        """Write a fresh snapshot of the table in place (at start, and when records outgrow it)."""
        if self._meta_fd is None or self._objects is None:
            return
        objects = [self._object_row(o) for o in self._objects.objects.values() if o.sealed and _restorable(o)]
        growables = [self._growable_row(g) for g in self._growables.by_name.values() if g.stored]
        pools = {name: pool.pool_info() for name, pool in self._pools.items()}
        table = {"version": META_VERSION, "objects": objects, "growables": growables, "pools": pools}
        data = msgpack.packb(table, use_bin_type=True)
        os.ftruncate(self._meta_fd, len(data))
        os.pwrite(self._meta_fd, data, 0)
        self._snapshot = self._end = len(data)

    def _append(self, record: dict) -> None:
        """One change after the snapshot, written at the end (a torn last record is ignored)."""
        if self._meta_fd is None or self._objects is None:
            return
        data = msgpack.packb(record, use_bin_type=True)
        if self._end + len(data) - self._snapshot > max(COMPACT_MIN, 2 * self._snapshot):
            self.save()   # (the live tables already hold this change)
            return
        os.pwrite(self._meta_fd, data, self._end)
        self._end += len(data)

    @staticmethod
    def _object_row(o) -> dict:
        e = o.alloc.export
        return {"name": o.name, "pool": o.alloc.pool.spec.name, "offset": e.offset, "size": e.size,
                "data": e.data, "sub": e.sub, "chunks": list(e.chunks), "fdkey": o.fdkey,
                "uid": o.alloc.uid, "meta": o.meta, "created": o.created}

    @staticmethod
    def _growable_row(g) -> dict:
        return {"gid": g.gid, "name": g.name, "pool": g.pool, "uid": g.uid, "chunks": list(g.memory.chunks),
                "gen": g.gen, "info": g.memory.info(), "fds": g.stored,
                "compression_requested": g.compression_requested}

    def close(self) -> None:
        for fd in self.inherited.values():
            os.close(fd)
        self.inherited.clear()
        if self._meta_fd is not None:
            os.close(self._meta_fd)
            self._meta_fd = None


def replay(data: bytes) -> dict:
    """The table a stored file describes: its snapshot with every complete record applied after."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    unpacker.feed(data)
    items = iter(unpacker)   # stops at a torn last record
    table = next(items, {})
    if not isinstance(table, dict) or table.get("version") not in READABLE:
        log.error("the stored object table has an unknown version; starting without it")
        return {}
    objects = {row["name"]: row for row in table.get("objects", [])}
    growables = {row["gid"]: row for row in table.get("growables", [])}
    for record in items:
        if "+o" in record:
            objects[record["+o"]["name"]] = record["+o"]
        elif "-o" in record:
            objects.pop(record["-o"], None)
        elif "+g" in record:
            growables[record["+g"]["gid"]] = record["+g"]
        elif "-g" in record:
            growables.pop(record["-g"], None)
    return {**table, "objects": list(objects.values()), "growables": list(growables.values())}


def _restorable(obj) -> bool:
    """Objects in a pool whose slabs are VMM chunks (``slab_memory = "vmm"``) are not stored: a
    restarted broker restores pool memory from the pool's FD, and a VMM slab is not in it."""
    e = obj.alloc.export
    return not (e.sub and e.chunks)
