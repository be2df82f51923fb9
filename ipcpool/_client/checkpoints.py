"""Checkpoints in a client: write a version (``VersionWriter``), attach one (``Checkpoint``).

A version's tensors lie at offsets in a few shards (large allocations): a writer imports each
shard once and writes every tensor through views of it; a reader imports the shards as one batch
of leases (``Leases._adopt_batch``) and builds its views from the manifest. The broker publishes a
version whole (``ckpt_publish``) or drops it (abort, or the writer's session ending), so a reader
never sees part of one.

The manifest travels as entries ``[name, dtype, shape, shard, offset, nbytes]``: added in pieces
that fit a request, read back in pages that fit a reply.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from .. import protocol
from ..errors import ClosedError, ObjectNotFound, WaitTimeout
from .channel import Channel
from .leases import Buffer, Leases
from .views import shard_views

ADD_BYTES = 48 << 10   # manifest bytes per ckpt_add (a request is at most MAX_MESSAGE)


@dataclass(frozen=True)
class Entry:
    """One tensor of a version: where its bytes lie."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    shard: int
    offset: int
    nbytes: int

    def wire(self) -> list:
        return [self.name, self.dtype, list(self.shape), self.shard, self.offset, self.nbytes]

    @classmethod
    def of(cls, e: list) -> Entry:
        if not isinstance(e, list) or len(e) != 6:
            raise protocol.ProtocolError("a manifest entry is [name, dtype, shape, shard, offset, nbytes]")
        return cls(e[0], e[1], tuple(e[2]), e[3], e[4], e[5])


class Checkpoints:
    """The checkpoint requests of one client."""

    def __init__(self, channel: Channel, leases: Leases):
        self._channel = channel
        self._leases = leases

    # -- writing -------------------------------------------------------------------------------
    def begin(self, name: str, shards: list[int], entries: list[Entry], *, pool: str, user: dict | None,
              exclusive: bool, stream: Any) -> VersionWriter | dict:
        """A new version in fresh shards with its manifest sent (``VersionWriter``); with
        ``exclusive`` the broker's ``{"busy": True, "current": ...}`` where another loads or loaded it."""
        fields: dict[str, Any] = {"name": name, "shards": [max(int(n), 1) for n in shards], "count": len(entries),
                                  "pool": pool}
        if user:
            fields["user"] = dict(user)
        if exclusive:
            fields["exclusive"] = True
        leases, channel = self._leases, self._channel
        with channel.lock:
            channel.check_open()
            reply = channel.call("ckpt_begin", **fields)
            if reply.get("busy"):
                return reply
            number = reply["version"]
            bufs: list[Buffer] = []
            try:
                for i, shard in enumerate(reply["shards"]):
                    bufs.append(leases._adopt(shard, stream, owner=True, name=f"{name}@{number}#{i}"))
                # The manifest in pieces, sent without waiting; then every answer.
                rids = [channel.send("ckpt_add", name=name, version=number, entries=piece)
                        for piece in _pieces([e.wire() for e in entries])]
                for rid in rids:
                    channel.wait_reply(rid, channel.timeout)
            except BaseException:
                self._drop(name, number, bufs, stream)
                raise
        return VersionWriter(self, name, number, bufs, entries)

    def _publish(self, w: VersionWriter, stream: Any) -> int:
        leases, channel = self._leases, self._channel
        with channel.lock:
            channel.check_open()
            done = []
            for buf in w._shards:
                leases.buffers.pop(id(buf), None)
                buf._freed = True
                done.append(leases.handoff.release(buf.pool, buf._memory, stream))
            fields = {"done_events": done} if any(done) else {}
            return channel.call("ckpt_publish", name=w.name, version=w.version, **fields)["version"]

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
            names = [f"{name}@{number}#{i}" for i in range(len(reply.get("alloc", ())))]
            try:
                leases._adopt_batch(reply, names, stream, out)
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

    def __init__(self, part: Checkpoints, name: str, version: int, shards: list[Buffer], entries: list[Entry]):
        self._part = part
        self.name = name
        self.version = version
        self._shards = shards
        self.entries = entries
        self.done = False

    @property
    def shards(self) -> list[Buffer]:
        """The shard buffers (``.ptr``, ``.size``, ``.device``): what a transfer engine registers."""
        return list(self._shards)

    def ranges(self) -> list[tuple[int, int, int | None]]:
        """``(address, size, device)`` of each shard (device None: host memory)."""
        return [(b.ptr, b.size, b.device) for b in self._shards]

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
