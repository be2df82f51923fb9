"""Checkpoints: a name -> versions, each a set of tensors in a few shards, published whole or not at all.

A version is written into a few large allocations (shards) with its tensors at offsets, so a
writer pays one allocation per shard and a reader one import per shard, not one per tensor. The
broker keeps the manifest (each tensor's name, dtype, shape, shard, offset and size) and hands it
out in pages. Holds are the registry's: a version holds its shards while it is current (or being
written), each reader session holds them while attached. So a replaced version lives exactly as
long as a reader holds it; then its memory becomes its checkpoint's spare, the next version's
(``spares``), or goes (R2 order kept: readers free with their done events like any lease). A
writer that dies before publishing leaves nothing: its version is dropped with its session, and
readers never saw it. A writer may keep the shards it published mapped (``publish(keep=...)``):
then its session's keeper holds them, which counts as no reader (``spares``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from ..errors import InvalidRequest, ObjectNotFound, QuotaExceeded
from ..protocol import CKPT_MAX_ENTRIES as MAX_ENTRIES
from ..protocol import CKPT_MAX_SHARDS as MAX_SHARDS
from .registry import Allocation, Registry
from .session import Session
from .spares import Spares

log = logging.getLogger(__name__)

MAX_WRITING = 16                 # versions one session writes at once
FORGOTTEN = 1 << 16              # names whose next version number is kept after they go


@dataclass(eq=False)
class Version:
    checkpoint: str
    number: int
    shards: list[Allocation]
    count: int                       # tensors it will hold: publish refuses fewer
    writer: Session | None
    user: dict
    entries: list[list] = field(default_factory=list)    # [name, dtype, shape, shard, offset, nbytes]
    names: set[str] = field(default_factory=set)
    published: bool = False
    retired: bool = False            # replaced or deleted: only its readers keep it
    created: float = field(default_factory=time.time)

    @property
    def nbytes(self) -> int:
        return sum(a.size for a in self.shards)

    def alive(self, registry: Registry) -> bool:
        """Its memory is its own: current (or being written), or replaced and still held by a
        reader (after the last, it may be a spare, the next version's memory)."""
        return all(registry.allocations.get(a.aid) is a for a in self.shards) and (
            not self.retired or self.holders() > 0)

    def holders(self) -> int:
        """Reader sessions holding it (the writer is none)."""
        return sum(1 for h in self.shards[0].holders if isinstance(h, Session) and h is not self.writer)

    def state(self, current: Version | None) -> str:
        if not self.published:
            return "writing"
        return "current" if self is current else "retired"


@dataclass(eq=False)
class Checkpoint:
    name: str
    versions: dict[int, Version] = field(default_factory=dict)
    current: Version | None = None
    next_number: int = 1


class CheckpointTable:
    def __init__(self, registry: Registry):
        self.registry = registry
        self.checkpoints: dict[str, Checkpoint] = {}
        self.spares = Spares(registry)
        registry.reclaim = self.spares.reclaim   # a pool or quota short: idle spares go first
        # The next version number of names forgotten (deleted, or their only writer died): numbers
        # never go back, so a reader's ``refresh`` never takes a new checkpoint for an old version.
        self._numbers: dict[str, int] = {}

    # -- writing -------------------------------------------------------------------------------
    def begin(self, session: Session, name: str, shards: list[int], count: int, pool: str, user: dict,
              exclusive: bool) -> Version | Checkpoint:
        """A new version of ``name`` (made if need be) in allocations of ``shards`` bytes (the
        checkpoint's spare where it fits, else fresh ones), written by ``session``. With
        ``exclusive`` (one loader elected among many): where the checkpoint has a current version
        or another live session is writing one, nothing is made and the checkpoint is returned
        instead (the caller attaches, or waits)."""
        if not shards or len(shards) > MAX_SHARDS:
            raise InvalidRequest(f"ckpt_begin: 1 to {MAX_SHARDS} shards, got {len(shards)}")
        if count > MAX_ENTRIES:
            raise InvalidRequest(f"ckpt_begin: at most {MAX_ENTRIES} tensors in a version, got {count}")
        ckpt = self.checkpoints.get(name)
        if exclusive and ckpt is not None and (
                ckpt.current is not None or any(not v.published for v in ckpt.versions.values())):
            return ckpt
        writing = sum(1 for c in self.checkpoints.values() for v in c.versions.values() if v.writer is session)
        if writing >= MAX_WRITING:
            raise QuotaExceeded(f"this session writes {writing} versions already; publish or abort some first")
        spare = self.spares.take(name, session, list(shards), pool)
        if spare is not None:
            allocs = spare.shards   # (the writer's hold taken)
            if ckpt is not None:
                ckpt.versions.pop(spare.version, None)   # no reader held it: its memory is the new one's
        else:
            allocs = self._allocate(session, shards, pool)
        if ckpt is None:
            ckpt = self.checkpoints[name] = Checkpoint(name, next_number=self._numbers.pop(name, 1))
        v = Version(name, ckpt.next_number, allocs, count, session, user)
        ckpt.next_number += 1
        ckpt.versions[v.number] = v
        for a in allocs:
            self.registry.hold(a, v)   # the version's own hold, until it is replaced or deleted
        return v

    def _allocate(self, session: Session, shards: list[int], pool: str) -> list[Allocation]:
        allocs: list[Allocation] = []
        try:
            for nbytes in shards:
                allocs.append(self.registry.allocate(session, nbytes, pool))   # the writer's hold
        except BaseException:
            for a in allocs:
                self.registry.free(session, a.aid)
            raise
        return allocs

    def add(self, session: Session, name: str, number: int, entries: list) -> Version:
        """More of a version's manifest, from its writer; each entry is checked against its shard."""
        v = self._writing(session, name, number)
        if len(v.entries) + len(entries) > v.count:
            raise InvalidRequest(f"checkpoint {name!r} version {number}: more than the {v.count} tensors declared")
        checked = [self._entry(v, i, e) for i, e in enumerate(entries)]
        new = [e[0] for e in checked]
        if len(set(new)) != len(new) or not v.names.isdisjoint(new):
            dup = next(n for i, n in enumerate(new) if n in v.names or n in new[:i])
            raise InvalidRequest(f"checkpoint {name!r} version {number}: tensor {dup[:80]!r} named twice")
        v.entries.extend(checked)
        v.names.update(new)
        return v

    def _entry(self, v: Version, i: int, e: list) -> list:
        """An entry the protocol checked (``check_entries``), against this version's shards."""
        name, dtype, shape, shard, offset, nbytes = e
        if shard >= len(v.shards) or offset + nbytes > v.shards[shard].size:
            raise InvalidRequest(f"entries[{i}]: {nbytes} bytes at {offset} do not fit in shard {shard}")
        return [name, dtype, list(shape), shard, offset, nbytes]

    def publish(self, session: Session, name: str, number: int, done_events: list[bytes],
                keep: list[int] = ()) -> tuple[Version, Version | None, bool]:
        """The writer is done (after each shard's ``done_events``, R2): the version becomes current
        at once, readers' next attach gets it. The shards at the indices ``keep`` stay mapped in
        the writer's client (its keeper holds them, ``spares``). Returns it, the version it
        replaced, and whether that one is the checkpoint's spare now."""
        v = self._writing(session, name, number)
        if len(v.entries) != v.count:
            raise InvalidRequest(f"checkpoint {name!r} version {number} has {len(v.entries)} of its "
                                 f"{v.count} tensors; add the rest before publishing")
        if done_events and len(done_events) != len(v.shards):
            raise InvalidRequest(f"ckpt_publish: one done event per shard ({len(v.shards)}), got {len(done_events)}")
        if any(i >= len(v.shards) for i in keep):
            raise InvalidRequest(f"ckpt_publish: keep names shards 0 to {len(v.shards) - 1} only")
        _check_disjoint(v)
        kept = set(keep)
        for i, (a, done) in enumerate(zip(v.shards, done_events or [b""] * len(v.shards))):
            a.pool.ordering.seal(a.handle, session.backend, done)   # readers order after it (join_seals)
            if i in kept:
                self.spares.keep_mapped(session, a)        # (before the writer's own hold goes)
            self.registry.free(session, a.aid)             # the writer's import (its done event ordered)
        v.writer, v.published = None, True
        ckpt = self.checkpoints[name]
        old, ckpt.current = ckpt.current, v
        spared = False
        if old is not None:
            spared = self.spares.keep(name, old.number, old.shards, v.shards)   # before the version lets go
            self._retire(ckpt, old)
        return v, old, spared

    def abort(self, session: Session, name: str, number: int) -> None:
        v = self._writing(session, name, number)
        self._drop_unpublished(self.checkpoints[name], v)

    def _writing(self, session: Session, name: str, number: int) -> Version:
        ckpt = self.checkpoints.get(name)
        v = ckpt.versions.get(number) if ckpt else None
        if v is None or v.published or v.writer is not session:
            raise InvalidRequest(f"checkpoint {name!r} has no version {number} this session is writing")
        return v

    def _drop_unpublished(self, ckpt: Checkpoint, v: Version) -> None:
        del ckpt.versions[v.number]
        writer, v.writer = v.writer, None
        for a in v.shards:
            if writer is not None and writer.held.get(a.aid):
                self.registry.free(writer, a.aid)
            self.registry.unhold(a, v, b"", None)
        self._forget_if_empty(ckpt)

    def _retire(self, ckpt: Checkpoint, v: Version) -> None:
        """Replaced (or deleted): the version lets go of its shards; its readers keep them."""
        v.retired = True
        for a in v.shards:
            self.registry.unhold(a, v, b"", None)
        if not v.alive(self.registry):
            ckpt.versions.pop(v.number, None)

    def _forget_if_empty(self, ckpt: Checkpoint) -> None:
        if not ckpt.versions and ckpt.current is None:
            self._forget(ckpt)

    def _forget(self, ckpt: Checkpoint) -> None:
        if self.checkpoints.pop(ckpt.name, None) is not None:
            if len(self._numbers) >= FORGOTTEN:
                del self._numbers[next(iter(self._numbers))]   # the oldest
            self._numbers[ckpt.name] = ckpt.next_number

    # -- reading -------------------------------------------------------------------------------
    def attach(self, session: Session, name: str, number: int | None) -> Version:
        """A read hold on ``name``'s current version (or version ``number`` while it is alive)."""
        ckpt = self.checkpoints.get(name)
        if ckpt is None:
            raise ObjectNotFound(f"no checkpoint named {name!r}")
        if number is None:
            v = ckpt.current
            if v is None:
                raise ObjectNotFound(f"checkpoint {name!r} has no published version yet")
        else:
            v = ckpt.versions.get(number)
            if v is None or not v.published or not v.alive(self.registry):
                live = sorted(n for n, x in ckpt.versions.items() if x.published and x.alive(self.registry))
                raise ObjectNotFound(f"checkpoint {name!r} has no version {number} (alive: {live or 'none'})")
        self.registry.hold_many(v.shards, session)
        return v

    def held(self, session: Session, name: str, number: int) -> Version:
        """A version ``session`` writes or holds (its manifest may be read)."""
        ckpt = self.checkpoints.get(name)
        v = ckpt.versions.get(number) if ckpt else None
        if v is None or not (v.writer is session or all(session.held.get(a.aid) for a in v.shards)):
            raise InvalidRequest(f"checkpoint {name!r} version {number} is not held by this session")
        return v

    # -- the catalogue -------------------------------------------------------------------------
    def delete(self, name: str) -> Checkpoint:
        """Forget ``name``: versions being written are aborted, the rest go once their readers let go."""
        ckpt = self.checkpoints.get(name)
        if ckpt is None:
            raise ObjectNotFound(f"no checkpoint named {name!r}")
        for v in list(ckpt.versions.values()):
            if not v.published:
                self._drop_unpublished(ckpt, v)
            elif not v.retired:
                self._retire(ckpt, v)
        self.spares.drop(name)
        ckpt.current = None
        self._forget(ckpt)
        return ckpt

    def prune(self) -> None:
        """Drop the records of retired versions whose last reader let go."""
        for ckpt in list(self.checkpoints.values()):
            for v in [v for v in ckpt.versions.values() if v.retired and not v.alive(self.registry)]:
                del ckpt.versions[v.number]
            self._forget_if_empty(ckpt)

    def info(self, ckpt: Checkpoint) -> dict:
        cur = ckpt.current
        return {
            "name": ckpt.name, "current": cur.number if cur else None, "spare": self.spares.idle_bytes(ckpt.name),
            "versions": [{"version": v.number, "state": v.state(cur), "tensors": len(v.entries),
                          "size": v.nbytes, "shards": len(v.shards), "holders": v.holders(),
                          "pool": v.shards[0].pool.spec.name, "created": v.created, "user": v.user}
                         for v in sorted(ckpt.versions.values(), key=lambda x: x.number)],
        }

    def stats(self) -> dict:
        self.prune()
        vs = [v for c in self.checkpoints.values() for v in c.versions.values()]
        return {"checkpoints": len(self.checkpoints), "versions": len(vs),
                "version_bytes": sum(v.nbytes for v in vs if v.alive(self.registry)),
                "spare_bytes": self.spares.idle_bytes(), "kept_bytes": self.spares.kept_bytes()}

    def end_session(self, session: Session) -> list[Version]:
        """A writer is gone: what it was writing goes (never published, never seen), and what its
        client kept mapped is let go."""
        dropped = []
        for ckpt in list(self.checkpoints.values()):
            for v in [v for v in ckpt.versions.values() if v.writer is session]:
                self._drop_unpublished(ckpt, v)
                dropped.append(v)
        self.spares.end_session(session)
        return dropped


def _check_disjoint(v: Version) -> None:
    """No two tensors of a version share a byte (a reader's view of one never shows another)."""
    spans = sorted((e[3], e[4], e[4] + e[5], e[0]) for e in v.entries if e[5])
    for (s1, _, end1, n1), (s2, start2, _, n2) in zip(spans, spans[1:]):
        if s1 == s2 and start2 < end1:
            raise InvalidRequest(f"checkpoint {v.checkpoint!r}: tensors {n1[:80]!r} and {n2[:80]!r} overlap")
