"""Spares: a replaced version's memory, kept once its readers let go, for its checkpoint's next version.

A trainer that publishes version k+1 every step would otherwise pay for fresh memory on the swap's
critical path (on CUDA: a cuMemCreate per chunk, a few ms per GiB, with k-1's release beside it),
and a swap could never come near the device-to-device copy of its bytes. Instead, the version a
publish replaces becomes its checkpoint's spare: its readers keep it as before, and once the last
has let go (and, on CUDA, every reader's done event has completed: never a wait on another
session's event, R3), the next version of the same layout is written into it.

Why a spare kept after a publish and not memory reserved at ``begin``: both cost one version's
memory at rest, but the spare is memory the swap already had (no allocation at all, ever, in a
steady loop), while a reservation is one more allocation each step, only moved off the clock.

The bound: a checkpoint keeps at most one spare, the version replaced last, and only where it is
laid out as the version that replaced it (a model swapped step after step) in the same pool and
charged to the same uid. At rest a swapped checkpoint holds two versions (current + spare), during
a swap still two (the spare becomes k+1, k the spare); a reader that lags holds its version as
before (the spare then is that version, and the next publish takes fresh memory). A checkpoint
published once keeps none. The spare goes with the checkpoint, when a version of another layout
is begun, and first of all when a pool or a uid's quota runs short (``reclaim``). Stats show it
(``spare_bytes``).

Kept mappings (``Keeper``): a writer whose client keeps the shards it wrote mapped (CUDA VMM
memory: the spare comes back to it two versions later, and importing, mapping and granting access
to every chunk again, then unmapping at the next publish, is the swap's own work) holds them
through its session's keeper. A keeper's hold keeps the memory alive and counted (the client still
maps it), but blocks no spare and is no reader: a spare held only by keepers is idle, and the
writer that takes it over uses its mapping again. The client lets go (``ckpt_unkeep``) of what it
will not be given again; whatever it still keeps goes with its session.
"""

from __future__ import annotations

from dataclasses import dataclass

from .registry import Allocation, Registry
from .session import Session


@dataclass(eq=False)
class Spare:
    """One checkpoint's spare: it holds the shards (a holder like a version) of ``version``."""

    shards: list[Allocation]
    version: int

    def idle(self) -> bool:
        """No reader holds it any more: besides this spare, only writers' keepers (idle mappings,
        their work ordered before the done events a renew waits for) hold each shard."""
        return all(all(h is self or type(h) is Keeper for h in a.holders) for a in self.shards)

    @property
    def nbytes(self) -> int:
        return sum(a.size for a in self.shards)


class Keeper:
    """One session's kept mappings: memory its client wrote a version into and still has mapped,
    held (a holder like a spare) until the client lets go or the session ends."""

    __slots__ = ("allocs", "session")

    def __init__(self, session: Session):
        self.session = session
        self.allocs: dict[int, Allocation] = {}


class Spares:
    def __init__(self, registry: Registry):
        self.registry = registry
        self.by_name: dict[str, Spare] = {}
        self.keepers: dict[Session, Keeper] = {}

    def keep(self, name: str, version: int, old: list[Allocation], new: list[Allocation]) -> bool:
        """``old`` (the shards of ``version``, just replaced by a version in ``new``) becomes the
        spare of ``name``, where the two are laid out alike; the spare before it goes. The caller
        then drops the old version's own hold. True where kept."""
        self.drop(name)
        if [a.size for a in old] != [a.size for a in new] or any(
                a.pool is not b.pool or a.uid != b.uid for a, b in zip(old, new)):
            return False
        spare = self.by_name[name] = Spare(list(old), version)
        for a in old:
            self.registry.hold(a, spare)
        return True

    def take(self, name: str, session: Session, sizes: list[int], pool: str) -> Spare | None:
        """The spare of ``name`` for a version of shard ``sizes`` that ``session`` writes, held by
        it from now on (the spare's hold gone), where it fits and is idle; else None. One that will
        never fit (another layout, pool or uid) goes now, before fresh memory is taken."""
        spare = self.by_name.get(name)
        if spare is None:
            return None
        if sizes != [a.size for a in spare.shards] or any(
                a.pool.spec.name != pool or a.uid != session.cred.uid for a in spare.shards):
            self.drop(name)
            return None
        # (A shard made ready while another is not yet stays a spare: nothing of it changed that matters.)
        if not spare.idle() or not all(a.pool.ordering.renew(a.handle) for a in spare.shards):
            return None   # a reader still on it: fresh memory this time
        del self.by_name[name]
        keeper = self.keepers.get(session)
        for a in spare.shards:
            self.registry.hold(a, session)            # the writer's hold, as an allocation's
            if keeper is not None and keeper.allocs.pop(a.aid, None) is not None:
                self.registry.unhold(a, keeper, b"", None)   # its client maps it already: used again
            self.registry.unhold(a, spare, b"", None)
        if keeper is not None and not keeper.allocs:
            del self.keepers[session]
        return spare

    def drop(self, name: str) -> None:
        """``name``'s spare goes (now, or with the last reader still on it)."""
        spare = self.by_name.pop(name, None)
        for a in spare.shards if spare is not None else ():
            self.registry.unhold(a, spare, b"", None)

    def reclaim(self, pool: str, uid: int) -> bool:
        """A pool or a uid's quota ran short: idle spares in ``pool`` or charged to ``uid`` go.
        True where any went (the caller tries again)."""
        gone = [n for n, s in self.by_name.items() if s.idle() and any(
            a.pool.spec.name == pool or a.uid == uid for a in s.shards)]
        for name in gone:
            self.drop(name)
        return bool(gone)

    # -- kept mappings ---------------------------------------------------------------------------
    def keep_mapped(self, session: Session, alloc: Allocation) -> None:
        """``session``'s client keeps ``alloc`` mapped after publishing the version written there
        (the caller drops the writer's own hold after this one is taken)."""
        keeper = self.keepers.get(session)
        if keeper is None:
            keeper = self.keepers[session] = Keeper(session)
        if alloc.aid not in keeper.allocs:
            keeper.allocs[alloc.aid] = alloc
            self.registry.hold(alloc, keeper)

    def unkeep(self, session: Session, aids: list[int]) -> int:
        """The client unmapped these (after its work on them): their keeper's holds go, and memory
        nothing else holds is freed. Ids it does not keep are ignored (the request has no answer).
        Returns how many went."""
        keeper = self.keepers.get(session)
        if keeper is None:
            return 0
        gone = 0
        for aid in aids:
            alloc = keeper.allocs.pop(aid, None)
            if alloc is not None:
                self.registry.unhold(alloc, keeper, b"", None)
                gone += 1
        if not keeper.allocs:
            del self.keepers[session]
        return gone

    def end_session(self, session: Session) -> None:
        """Its process closed or is gone: whatever it kept mapped is let go."""
        keeper = self.keepers.pop(session, None)
        for alloc in keeper.allocs.values() if keeper is not None else ():
            self.registry.unhold(alloc, keeper, b"", None)

    def kept_bytes(self) -> int:
        """Bytes that only writers' kept mappings hold: no version, spare or reader has them (the
        broker would have freed them); they go once those clients let go."""
        seen: dict[int, Allocation] = {}
        for keeper in self.keepers.values():
            seen.update(keeper.allocs)
        return sum(a.size for a in seen.values() if all(type(h) is Keeper for h in a.holders))

    def idle_bytes(self, name: str | None = None) -> int:
        """Bytes of spares no reader holds (memory kept only for a next version): ``name``'s, or all."""
        spares = self.by_name.values() if name is None else [self.by_name[name]] if name in self.by_name else []
        return sum(s.nbytes for s in spares if s.idle())
