"""Broker memory that outlives the broker: pool FDs and a metadata memfd in systemd's FD store.

At start the broker stores each durable pool's FD (FDSTORE=1, FDNAME=pool-<name>) and a memfd
holding the table of sealed objects and growable buffers (FDNAME=meta), which it rewrites in place
as they change (systemd holds the same open file). A growable buffer's FDs are stored as it is
created and grown (FDNAME=grow-<id>-<n>) and removed when it is released. A broker started with
those FDs ($LISTEN_FDS, $LISTEN_FDNAMES, $LISTEN_PID) adopts the pools and growables and re-creates
the sealed objects where they were: a crash or an upgrade loses no weights. Anonymous allocations and unsealed objects
belong to sessions, which a restart ends, so they are not kept.
"""

from __future__ import annotations

import logging
import os

import msgpack

from .systemd import Notifier

log = logging.getLogger(__name__)

LISTEN_FDS_START = 3
META_NAME = "meta"
META_VERSION = 1


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
        if self._meta_fd is not None:
            log.info("adopting %d FD(s) from the FD store", len(self.inherited) + 1)

    @property
    def enabled(self) -> bool:
        return self.notifier.enabled

    def take_pool_fd(self, name: str) -> int | None:
        return self.inherited.pop(f"pool-{name}", None)   # FDNAME allows no colon

    def take_growable_fds(self, gid: int, count: int) -> list[int] | None:
        """A stored growable's FDs, or None (and none taken) if any is missing."""
        names = [f"grow-{gid}-{i}" for i in range(count)]
        if not all(n in self.inherited for n in names):
            return None
        return [self.inherited.pop(n) for n in names]

    def stored_objects(self) -> list[dict]:
        """The sealed objects a previous broker recorded (empty on a fresh start)."""
        return self._stored("objects")

    def stored_growables(self) -> list[dict]:
        return self._stored("growables")

    def _stored(self, key: str) -> list[dict]:
        if self._meta_fd is None:
            return []
        try:
            size = os.fstat(self._meta_fd).st_size
            table = msgpack.unpackb(os.pread(self._meta_fd, size, 0), raw=False) if size else {}
        except (OSError, ValueError, msgpack.UnpackException) as exc:
            log.error("the stored object table is unreadable (%s); starting without it", exc)
            return []
        if not isinstance(table, dict) or table.get("version") != META_VERSION:
            log.error("the stored object table has an unknown version; starting without it")
            return []
        return list(table.get(key, []))

    def store(self, pools: dict) -> None:
        """Hand the pools' FDs and the object table's memfd to systemd (duplicates are ignored)."""
        for name in list(self.inherited):   # stored by an older config: let systemd drop them
            os.close(self.inherited.pop(name))
            self.notifier.notify("FDSTOREREMOVE=1", f"FDNAME={name}")
        if not self.enabled:
            return
        for name, pool in pools.items():
            self.notifier.notify("FDSTORE=1", f"FDNAME=pool-{name}", fds=(pool.fd,))
        if self._meta_fd is None:
            self._meta_fd = os.memfd_create("ipcpool:meta", os.MFD_CLOEXEC)
        self.notifier.notify("FDSTORE=1", f"FDNAME={META_NAME}", fds=(self._meta_fd,))

    def tables(self, objects, growables) -> None:
        """The tables ``save`` records."""
        self._objects, self._growables = objects, growables

    def store_growable(self, g) -> None:
        """Hand systemd the growable's FDs it does not hold yet (new chunks)."""
        fds = g.memory.fds(0)
        if self.enabled:
            for i in range(g.stored, len(fds)):
                self.notifier.notify("FDSTORE=1", f"FDNAME=grow-{g.gid}-{i}", fds=(fds[i],))
        g.stored = len(fds)

    def unstore_growable(self, g) -> None:
        if self.enabled:
            for i in range(g.stored):
                self.notifier.notify("FDSTOREREMOVE=1", f"FDNAME=grow-{g.gid}-{i}")
        g.stored = 0

    def save(self) -> None:
        """Rewrite the table in place (after each seal, delete, and growable change)."""
        if self._meta_fd is None or self._objects is None:
            return
        objects = [
            {"name": o.name, "pool": o.alloc.pool.spec.name, "offset": o.alloc.export.offset,
             "size": o.alloc.size, "uid": o.alloc.uid, "meta": o.meta, "created": o.created}
            for o in self._objects.objects.values() if o.sealed
        ]
        growables = [
            {"gid": g.gid, "name": g.name, "pool": g.pool, "uid": g.uid, "chunks": list(g.memory.chunks),
             "gen": g.gen, "info": g.memory.info(), "fds": g.stored, "compression_requested": g.compression_requested}
            for g in self._growables.by_name.values() if g.stored
        ]
        table = {"version": META_VERSION, "objects": objects, "growables": growables}
        data = msgpack.packb(table, use_bin_type=True)
        os.ftruncate(self._meta_fd, len(data))
        os.pwrite(self._meta_fd, data, 0)

    def close(self) -> None:
        for fd in self.inherited.values():
            os.close(fd)
        self.inherited.clear()
        if self._meta_fd is not None:
            os.close(self._meta_fd)
            self._meta_fd = None
