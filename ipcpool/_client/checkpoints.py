"""Checkpoints in a client: write a version (``VersionWriter``), attach one (``Checkpoint``).

A version's tensors lie at offsets in a few shards (large allocations): a writer imports each
shard once and writes every tensor through views of it; a reader imports the shards as one batch
of leases (``Leases.adopt_batch``) and builds its views from the manifest. The broker publishes a
version whole (``ckpt_publish``) or drops it (abort, or the writer's session ending), so a reader
never sees part of one.

The manifest travels as entries ``[name, dtype, shape, shard, offset, nbytes]``: added in pieces
that fit a request, read back in pages that fit a reply.

A writer keeps the shards it published imported where that saves work (``ClientPool.keep``: CUDA
memory mapped from VMM chunks) and writes into them again when the broker hands the same
allocation back as the checkpoint's spare, two versions later: no chunk FDs fetched, imported,
mapped and granted access at ``begin``, and no host wait for the copy and no unmap at ``publish``
(the broker learns of it, ``spares.Keeper``). It keeps only what may come back, the version it
published last and the one that version replaced where that is the spare; the rest it lets go
(``ckpt_unkeep``) at its next publish or begin of that checkpoint, when it deletes it, when a begin
finds the pool short (then all, and the begin is tried once more), and at ``close``. Loaders keep
nothing (a version published once is never a spare of theirs).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from .. import protocol, trace
from ..backend.base import ImportedMemory
from ..errors import ClosedError, IpcPoolError, ObjectNotFound, OutOfMemory, QuotaExceeded, WaitTimeout
from ..weights.layout import Entry
from ..replies import Allocation, Batch
from .channel import Channel
from .leases import Buffer, Leases
from .views import shard_views

log = logging.getLogger(__name__)

ADD_BYTES = 48 << 10   # manifest bytes per ckpt_add (a request is at most MAX_MESSAGE)


@dataclass
class _Kept:
    """A published shard still imported here (``ClientPool.keep``), until let go."""

    name: str                 # its checkpoint
    version: int              # the version written there last
    pool: str
    memory: ImportedMemory
    token: Any                # for ``ClientPool.drop_kept``


class Checkpoints:
    """The checkpoint requests of one client."""

    def __init__(self, channel: Channel, leases: Leases):
        self._channel = channel
        self._leases = leases
        self._kept: dict[int, _Kept] = {}   # allocation id -> a shard this writer still has imported

    # -- writing -------------------------------------------------------------------------------
    @trace.phase("begin")
    def begin(self, name: str, shards: list[int], entries: list[Entry], *, pool: str, user: dict | None,
              exclusive: bool, stream: Any, keep: bool = True) -> VersionWriter | dict:
        """A new version in fresh shards (or the spare, imported again only where this writer
        does not keep it imported already) with its manifest sent (``VersionWriter``); with
        ``exclusive`` the broker's ``{"busy": True, "current": ...}`` where another loads or loaded
        it. ``keep``: keep the shards imported after the publish (see the module's doc)."""
        fields: dict[str, Any] = {"name": name, "shards": [max(int(n), 1) for n in shards], "count": len(entries),
                                  "pool": pool}
        if user:
            fields["user"] = dict(user)
        if exclusive:
            fields["exclusive"] = True
        leases, channel = self._leases, self._channel
        with channel.lock:
            channel.check_open()
            try:
                reply = channel.call("ckpt_begin", **fields)
            except (OutOfMemory, QuotaExceeded):
                if not self._kept:
                    raise
                # Memory this writer keeps imported is memory the broker cannot take back (a
                # spare it dropped, say): let all of it go, then ask once more.
                self._let_go(list(self._kept))
                reply = channel.call("ckpt_begin", **fields)
            if reply.get("busy"):
                return reply
            number = reply["version"]
            bufs: list[Buffer] = []
            try:
                for i, shard in enumerate(map(Allocation.decode, reply["shards"])):
                    label = f"{name}@{number}#{i}"
                    kept = self._kept.pop(shard.alloc, None)
                    if kept is not None and kept.pool == shard.pool and kept.memory.size == shard.export.size:
                        # The spare, imported here since this writer published into it: no import.
                        bufs.append(leases.keep(shard.alloc, kept.pool, kept.memory, True, label, None, False))
                        continue
                    if kept is not None:   # (never: an allocation keeps its pool and size)
                        self._unimport(kept)
                        channel.send("ckpt_unkeep", allocs=[shard.alloc])
                    bufs.append(leases.adopt(shard, stream, owner=True, name=label))
                # What this begin did not take will not come back: only the newest version's stays.
                mine = [k.version for k in self._kept.values() if k.name == name]
                if mine:
                    newest = max(mine)
                    self._let_go([a for a, k in self._kept.items() if k.name == name and k.version != newest])
                # The manifest in pieces, sent without waiting; then every answer.
                rids = [channel.send("ckpt_add", name=name, version=number, entries=piece)
                        for piece in _pieces([e.wire() for e in entries])]
                for rid in rids:
                    channel.wait_reply(rid, channel.timeout)
            except BaseException:
                self._drop(name, number, bufs, stream)
                raise
        return VersionWriter(self, name, number, bufs, entries, keep)

    @trace.phase("publish")
    def _publish(self, w: VersionWriter, stream: Any) -> int:
        leases, channel = self._leases, self._channel
        with channel.lock:
            channel.check_open()
            done, keep, kept = [], [], []
            for i, buf in enumerate(w._shards):
                leases.hand_over(buf)
                got = leases.handoff.keep(buf.pool, buf.memory, stream) if w._keep else None
                if got is None:   # released: on CUDA a VMM mapping waits for the work, then unmaps
                    done.append(leases.handoff.release(buf.pool, buf.memory, stream))
                    continue
                done.append(got[0])
                keep.append(i)
                kept.append((buf.alloc_id, _Kept(w.name, w.version, buf.pool, buf.memory, got[1])))
            fields: dict[str, Any] = {"done_events": done} if any(done) else {}
            if keep:
                fields["keep"] = keep
            try:
                reply = channel.call("ckpt_publish", name=w.name, version=w.version, **fields)
            except BaseException:
                for _, k in kept:   # refused: the broker keeps none of it for us
                    self._unimport(k)
                raise
            self._kept.update(kept)
            # Kept beyond this version: only the one it replaced, where that is the spare now (this
            # writer's next version but one is written there).
            spare = reply.get("replaced") if reply.get("spare") else None
            self._let_go([a for a, k in self._kept.items()
                          if k.name == w.name and k.version not in (w.version, spare)])
            return reply["version"]

    def _unimport(self, kept: _Kept) -> None:
        """Drop a kept import here (after the work queued on it); the broker is told by the caller."""
        pool = self._leases.handoff.imported(kept.pool)
        if pool is not None:
            pool.drop_kept(kept.memory, kept.token)

    @trace.phase("let_go")
    def _let_go(self, aids: list[int]) -> None:
        """Drop these kept imports and tell the broker (one way), which frees what nothing else holds."""
        gone: list[int] = []
        try:
            for aid in aids:
                kept = self._kept.pop(aid, None)
                if kept is not None:
                    gone.append(aid)
                    self._unimport(kept)
        finally:
            if gone and not self._channel.closed:
                for at in range(0, len(gone), protocol.MAX_ARRAY):
                    self._channel.send("ckpt_unkeep", allocs=gone[at : at + protocol.MAX_ARRAY])

    def close(self) -> None:
        """Drop every kept import (the session's end lets the broker's holds go); a failure is
        logged, so that closing goes on."""
        kept, self._kept = list(self._kept.values()), {}
        for k in kept:
            try:
                self._unimport(k)
            except IpcPoolError as exc:
                log.warning("dropping a kept import of checkpoint %r failed: %s", k.name, exc)

    def _abort(self, w: VersionWriter, stream: Any) -> None:
        self._drop(w.name, w.version, w._shards, stream)

    def _drop(self, name: str, version: int, shards: list[Buffer], stream: Any) -> None:
        """An unpublished version goes: its shards freed here, then the broker told."""
        for buf in shards:
            buf.free(stream)
        if not self._channel.closed:
            self._channel.call("ckpt_abort", name=name, version=version)

    # -- reading -------------------------------------------------------------------------------
    def attach(self, name: str, version: int | None, kind: str, stream: Any, newer_than: int | None = None) -> Any:
        """``(version, leases, entries, user)`` of ``name``'s current version (or ``version``);
        None where ``newer_than`` is given and the current version is no newer."""
        fields: dict[str, Any] = {"name": name}
        if version is not None:
            fields["version"] = version
        if newer_than is not None:
            fields["newer_than"] = newer_than
        leases, channel = self._leases, self._channel
        with channel.lock:
            channel.check_open()
            reply = channel.call("ckpt_attach", **fields)
            if reply.get("same"):
                return None
            number = reply["version"]
            out: list[Buffer] = []
            shards = Batch.decode(reply)
            names = [f"{name}@{number}#{i}" for i in range(len(shards.alloc))]
            try:
                leases.adopt_batch(shards, names, stream, out)
                raw = list(reply["entries"])
                while reply.get("more"):   # a manifest of more than a page
                    reply = channel.call("ckpt_manifest", name=name, version=number, start=len(raw))
                    if not reply["entries"]:
                        raise protocol.ProtocolError("ckpt_manifest: an empty page that says more")
                    raw.extend(reply["entries"])
                entries = [Entry.of(e) for e in raw]
            except BaseException:
                for b in out:
                    b.free(stream)
                raise
        return number, out, entries, reply_user(reply)

    def list(self, prefix: str) -> list[dict]:
        out: list[dict] = []
        after = ""
        while True:
            reply = self._channel.call("ckpt_list", prefix=prefix, after=after)
            out.extend(reply["checkpoints"])
            if not reply.get("more"):
                return out
            after = reply["after"]

    def delete(self, name: str) -> None:
        with self._channel.lock:
            self._let_go([a for a, k in self._kept.items() if k.name == name])
            self._channel.call("ckpt_delete", name=name)


def reply_user(reply: dict) -> dict:
    user = reply.get("user")
    return dict(user) if isinstance(user, dict) else {}


def _pieces(wire: list[list]) -> list[list[list]]:
    """Entries cut into requests of at most MAX_ARRAY entries and ADD_BYTES."""
    out: list[list[list]] = []
    cur: list[list] = []
    size = 0
    for e in wire:
        n = 48 + len(e[0].encode()) + 9 * len(e[2])
        if cur and (len(cur) >= protocol.MAX_ARRAY or size + n > ADD_BYTES):
            out.append(cur)
            cur, size = [], 0
        cur.append(e)
        size += n
    if cur:
        out.append(cur)
    return out


class VersionWriter:
    """A version being written: fill its tensors, then ``publish()`` (or leave the ``with`` block
    on an error: the version is dropped, no reader ever sees it)."""

    def __init__(self, part: Checkpoints, name: str, version: int, shards: list[Buffer], entries: list[Entry],
                 keep: bool = True):
        self._part = part
        self.name = name
        self.version = version
        self._shards = shards
        self.entries = entries
        self.done = False
        self._keep = keep   # keep the shards imported after the publish (``Checkpoints``)

    @property
    def shards(self) -> list[Buffer]:
        """The shard buffers (``.ptr``, ``.size``, ``.device``): what a transfer engine registers."""
        return list(self._shards)

    def ranges(self) -> list[tuple[int, int, int | None]]:
        """``(address, size, device)`` of each shard (device None: host memory)."""
        return [(b.ptr, b.size, b.device) for b in self._shards]

    @trace.phase("views")
    def tensors(self, kind: str = "torch") -> dict[str, Any]:
        """Writable views of every tensor (``kind``: torch, numpy or cupy)."""
        self._live()
        return shard_views(self._shards, self.entries, kind, writable=True)

    def publish(self, stream: Any = None) -> int:
        """Make this version current, after the work on ``stream``; returns its number."""
        self._live()
        self.done = True
        return self._part._publish(self, stream)

    def abort(self, stream: Any = None) -> None:
        if self.done:
            return
        self.done = True
        self._part._abort(self, stream)

    def _live(self) -> None:
        if self.done:
            raise ClosedError(f"version {self.version} of {self.name!r} was published or aborted already")

    def __enter__(self) -> VersionWriter:
        return self

    def __exit__(self, *exc) -> None:
        if not self.done:
            self.abort()


class Checkpoint:
    """An attached checkpoint version: ``tensors`` (name -> zero-copy tensor or array),
    ``version``, ``refresh()`` to move to the newest, ``release()`` (or ``with``) to let go."""

    def __init__(self, part: Checkpoints, name: str, kind: str, stream: Any, attached: tuple):
        self._part = part
        self.name = name
        self.kind = kind
        self._stream = stream
        self._leases: list[Buffer] = []
        self._take(attached)

    def _take(self, attached: tuple) -> None:
        number, leases, entries, user = attached
        try:
            tensors = shard_views(leases, entries, self.kind, writable=False)
        except BaseException:
            for b in leases:
                b.free(self._stream)
            raise
        self.version, self._leases, self.entries, self.user, self.tensors = number, leases, entries, user, tensors

    @property
    def released(self) -> bool:
        return not self._leases

    def ranges(self) -> list[tuple[int, int, int | None]]:
        """``(address, size, device)`` of each shard: what a transfer engine registers."""
        return [(b.ptr, b.size, b.device) for b in self._leases]

    @property
    def shard_sizes(self) -> list[int]:
        return [b.size for b in self._leases]

    def refresh(self, stream: Any = None) -> bool:
        """Move to the current version if it is newer than this one (one round trip when it is
        not): the tensors are replaced and the old version released. True when it moved. Any
        tensor of the old version still in use must be dropped first (its memory may go)."""
        if self.released:
            raise ClosedError(f"checkpoint {self.name!r} was released")
        stream = self._stream if stream is None else stream
        got = self._part.attach(self.name, None, self.kind, stream, newer_than=self.version)
        if got is None:
            return False
        old = self._leases
        self._take(got)
        for b in old:
            b.free(stream)
        return True

    def release(self, stream: Any = None) -> None:
        """Let go of the version (its memory goes once no one holds it); idempotent."""
        leases, self._leases = self._leases, []
        self.tensors = {}
        for b in leases:
            b.free(self._stream if stream is None else stream)

    close = release

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self.released else f"{len(self.entries)} tensors"
        return f"<ipcpool.Checkpoint {self.name!r} version {self.version} ({state})>"


def wait_attach(part: Checkpoints, name: str, version: int | None, kind: str, stream: Any,
                timeout: float | None) -> Checkpoint:
    """Attach, waiting up to ``timeout`` seconds for a first version to be published."""
    deadline = None if timeout is None else time.monotonic() + timeout
    pause = 0.001
    while True:
        try:
            return Checkpoint(part, name, kind, stream, part.attach(name, version, kind, stream))
        except ObjectNotFound:
            if timeout == 0 or version is not None:   # not waiting: as the broker said it
                raise
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeout(f"checkpoint {name!r} was not published within {timeout} s") from None
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
