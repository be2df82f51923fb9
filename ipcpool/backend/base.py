"""The seam between ipcpool and a kind of memory: host (memfd) or CUDA (IPC mempools).

The broker and the client only ever talk to these classes; only the CUDA backend imports cuda.*.

Broker side: a ``BrokerBackend`` creates ``BrokerPool``s (one exportable pool each) and one
``SessionContext`` per client session (a CUDA stream, so waits on one client's events never stall
another: rule R3). A pool allocates and returns an ``Export``: everything a client needs to import
that allocation, as plain bytes and ints that travel in msgpack. A pool is memory only; its other
concepts are seams of their own that the broker reaches through it: ``pool.ordering`` (events,
credits, done waits: ``ordering.Ordering``, a null one where there is no asynchronous work),
``pool.arenas`` (carving) and ``pool.usage`` (stats, limit, trim).

Client side: a ``ClientBackend`` imports a pool from its FD (received over the control socket) and
the ``pool_info`` map, then imports allocations from their ``Export``s. Releasing an import yields
the *done* event handle the broker must wait on before it frees (rule R2).
"""

from __future__ import annotations

import ctypes
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from ..fds import close_all
from ..errors import BackendUnavailable, InvalidRequest, IpcPoolError
from .records import REUSE_POLICIES, Export, PoolSpec, PoolStats, SessionContext
from .growables import BrokerGrowable, ClientGrowable
from .ordering import NULL_ORDERING, NullOrdering, Ordering
from .stock import ChunkStock

__all__ = [
    "NO_ARENAS", "NULL_ORDERING", "REUSE_POLICIES", "Arenas", "BrokerBackend", "BrokerGrowable", "BrokerPool",
    "ClientBackend", "ClientGrowable", "ClientPool", "Export", "ImportedMemory", "NoArenas", "NullOrdering",
    "Ordering", "PoolSpec", "PoolStats", "SessionContext", "Usage",
]

class Arenas(ABC):
    """Carving: a pool's allocations that a client carves objects from itself (arenas). A pool
    that carves its own allocations implements it too, listed before ``BrokerPool``: it is then its
    own ``arenas``."""

    @property
    def arenas(self) -> Arenas:
        return self

    @property
    @abstractmethod
    def arena_limit(self) -> int:
        """The largest arena (an allocation a client carves objects from itself) this pool hands
        out; 0 where its allocations cannot be carved."""

    @abstractmethod
    def carve(self, handle: object, export: Export, offset: int, nbytes: int,
              on_idle: Callable[[], None]) -> tuple[object, Export]:
        """The range [``offset``, +``nbytes``) of arena ``handle`` as an allocation of its own. It
        is freed like any other (after every importer's done event, R2), except that its memory
        stays the arena's: ``on_idle()`` is called then instead. The range is idle on the device
        whenever it is handed to its arena's client, so it needs no ready event."""

    @abstractmethod
    def shrink(self, handle: object, keep: list[tuple[int, int]]) -> int:
        """An arena (``handle``) whose session is gone keeps only ``keep``, the (offset, size) of
        each object still in it; give the rest back to the pool and return how many bytes. Each
        kept part is then freed alone by ``free_part``, and ``free`` frees no more. 0: not done
        (the arena is freed whole with its last object)."""

    @abstractmethod
    def free_part(self, handle: object, offset: int) -> None:
        """The kept part at ``offset`` of a shrunk arena is idle: give it back to the pool."""


class NoArenas(Arenas):
    """A pool whose allocations cannot be carved (the broker asks ``arena_limit`` first)."""

    arena_limit = 0

    def carve(self, handle: object, export: Export, offset: int, nbytes: int,
              on_idle: Callable[[], None]) -> tuple[object, Export]:
        raise InvalidRequest("this pool cannot carve its allocations")

    def shrink(self, handle: object, keep: list[tuple[int, int]]) -> int:
        return 0

    def free_part(self, handle: object, offset: int) -> None:
        pass


NO_ARENAS = NoArenas()


class Usage(ABC):
    """What a pool holds and how much it keeps reserved: its statistics, its limit, trimming. A
    pool implements it too, listed before ``BrokerPool``: it is then its own ``usage``."""

    @property
    def usage(self) -> Usage:
        return self

    @property
    @abstractmethod
    def byte_limit(self) -> int:
        """The bytes this pool may hold, growable buffers included: its max_size; 0 where only the
        device's memory limits it."""

    @abstractmethod
    def stats(self) -> PoolStats: ...

    @abstractmethod
    def reset_high(self) -> None: ...

    @abstractmethod
    def trim(self, keep: int) -> None:
        """Give freed memory back to the system until at most ``keep`` bytes stay reserved."""

    @abstractmethod
    def set_release_threshold(self, nbytes: int) -> None: ...


class BrokerPool(ABC):
    """One exportable pool: memory only. Its other concepts are seams of their own, reached
    through it: ``ordering`` (events and done waits; none on the host), ``arenas`` (carving) and
    ``usage`` (stats, limit, trim)."""

    spec: PoolSpec
    # A restored pool that keeps the memory restored objects live in but cannot allocate (CUDA: an
    # imported pool). The registry then creates a fresh pool of the same spec for new memory.
    read_only = False
    ordering: Ordering = NULL_ORDERING
    arenas: Arenas = NO_ARENAS

    @property
    @abstractmethod
    def usage(self) -> Usage: ...

    @property
    @abstractmethod
    def fd(self) -> int:
        """The pool's exportable FD. Owned by the pool; sent as-is (SCM_RIGHTS duplicates it)."""

    @abstractmethod
    def pool_info(self) -> dict[str, Any]:
        """What a client needs besides the FD to import this pool (msgpack-able)."""

    @abstractmethod
    def allocate(self, nbytes: int, session: SessionContext) -> tuple[object, Export]:
        """Allocate on the session's stream; return an opaque handle and its export."""

    @abstractmethod
    def free(self, handle: object, session: SessionContext, done_event: bytes = b"") -> None:
        """Free after ``done_event`` (if any) and every event given to ``ordering.add_release``
        for this handle have completed, without blocking the host (R2)."""

    def chunk_fds(self, handle: object) -> list[int]:
        """The FDs of a VMM-backed allocation's chunks (``Export.chunks``), owned by the pool and
        sent as-is; empty for memory that needs none beyond the pool's own FD."""
        return []

    def restore(self, row: dict[str, Any], fds: list[int]) -> tuple[object, Export]:
        """Restore an allocation that lived in this pool before a broker restart: ``row`` has the
        export's fields as ``durable`` stored them, ``fds`` its chunk FDs (owned; closed on error)."""
        close_all(fds)
        raise BackendUnavailable(f"pool {self.spec.name!r}: this backend cannot re-adopt allocations")

    @abstractmethod
    def close(self) -> None: ...


class BrokerBackend(ABC):
    name: str
    durable = False   # pools can be handed to systemd's FD store and restored after a restart
    _own_context: SessionContext | None = None   # see ``broker_context``

    def adopt_pool(self, spec: PoolSpec, fd: int, info: dict[str, Any]) -> BrokerPool:
        """Restore a pool from the FD a previous broker stored (takes ownership of ``fd``), with
        the ``pool_info`` it recorded. (Seam methods keep the name ``adopt_*``; inside the backends
        this meaning is called restoring.)"""
        raise BackendUnavailable(f"the {self.name} backend cannot re-adopt pools")

    @abstractmethod
    def create_pool(self, spec: PoolSpec) -> BrokerPool: ...

    def create_growable(self, spec: PoolSpec, nbytes: int, compression: bool,
                        stock: ChunkStock | None = None) -> BrokerGrowable:
        """Memory of ``nbytes`` (rounded up to the granularity) on ``spec``'s device that can grow
        while keeping its contents, as chunks every client maps in order (taken from ``stock``
        first, where it fits)."""
        raise BackendUnavailable(f"the {self.name} backend has no growable buffers")

    def chunk_stock(self, spec: PoolSpec, target: int) -> ChunkStock | None:
        """An empty stock of up to ``target`` bytes of chunks for ``spec``'s growable buffers (see
        ``stock``); None where chunks cost nothing to make when asked (the host)."""
        return None

    def adopt_growable(self, spec: PoolSpec, info: dict[str, Any], chunks: list[int], fds: list[int]) -> BrokerGrowable:
        """Restore a growable a previous broker stored (takes ownership of ``fds``)."""
        raise BackendUnavailable(f"the {self.name} backend cannot re-adopt growable buffers")

    @abstractmethod
    def open_session(self) -> SessionContext: ...

    @property
    def pending_frees(self) -> int:
        """Frees waiting on done events (R2): while any are, the broker calls ``sweep`` often."""
        return 0

    def sweep(self) -> None:
        """Run the frees whose done events have completed; never blocks."""

    def foreign_error(self, exc: Exception) -> IpcPoolError | None:
        """``exc`` as an ipcpool error where it is this backend's own failure (a CUDA error from
        the driver, say); None for anything else, which the broker reports as a bug of its own."""
        return None

    def startup_warnings(self) -> list[str]:
        """What an operator must know about this machine before trusting the broker with work
        (logged at start as warnings), e.g. a device shared through CUDA MPS."""
        return []

    def broker_context(self) -> SessionContext:
        """A context of the broker's own, for work no live session orders (a named object deleted
        after its last reader left). Its stream never waits on a client's event (R3)."""
        if self._own_context is None:
            self._own_context = self.open_session()
        return self._own_context

    def close(self) -> None:
        """Release backend-wide resources (after every pool is closed)."""


class ImportedMemory(ABC):
    """One imported allocation in a client: the memory protocol ``Buffer`` and ``interop`` use.
    Each kind of memory answers what it is; a capability it lacks is None, never a missing name."""

    size: int
    device: int | None = None        # the CUDA device holding it; None for host memory
    view: memoryview | None = None   # the bytes, where the CPU can address them

    @property
    @abstractmethod
    def ptr(self) -> int: ...

    @property
    def cuda_array_interface(self) -> dict[str, Any] | None:
        """``__cuda_array_interface__`` (version 3) where the memory is on a GPU."""
        return None

    def dlpack(self, **kwargs: Any) -> Any:
        """A DLPack capsule of the bytes (uint8)."""
        raise AttributeError("__dlpack__: not CUDA memory")

    def dlpack_device(self) -> tuple[int, int]:
        raise AttributeError("__dlpack_device__: not CUDA memory")

    def ready(self) -> None:
        """Wait for an import still running in the background (CUDA slabs); raise its failure."""

    def slab(self) -> tuple[ImportedMemory, int] | None:
        """(the larger allocation this is a range of, its offset there), where the backend keeps
        one imported for many small ones (CUDA slabs): a framework can view the whole once."""
        return None

    def copy_from_host(self, src: memoryview, offset: int, backend: ClientBackend, stream: Any) -> None:
        """Host bytes into this memory at ``offset``, ordered on ``stream``."""
        if self.view is None:
            raise InvalidRequest("this memory cannot be written from the host")
        self.view[offset : offset + src.nbytes] = src


class Unrecorded:
    """What a seal records on where it records nothing (host memory): ``seal_target``'s; never closed."""

    __slots__ = ()
    ptr = 0
    handle = True


UNRECORDED = Unrecorded()


class ClientPool(ABC):
    # Readers order their work after a seal's event: writers record each seal on one (CUDA).
    seal_event = False
    # The driver's event query in one C call (an event's CUevent as an int -> its CUresult, -1
    # without a driver), where the client has one to give (``shm.sealboard.event_query``).
    query_event: Callable[[int], int] | None = None
    # The broker's credits opened here, as the table a reader's take in C finds a seal's CUevent in
    # (``cuda.credits``; ``shm.leases.ClientLeasePage.take_in_c``). None where a pool has no events.
    open_credits: bytearray | None = None

    def order_after(self, event: bytes, stream: Any = None, credit: bool = False) -> None:
        """Order the work on ``stream`` after the peer's IPC event ``event`` (R1): nothing once the
        host sees it complete, else after a bounded spin a stream wait. Nothing where there are no
        events. ``credit``: ``event`` is one of the broker's credits, which may be kept open."""

    @abstractmethod
    def import_allocation(self, export: Export, stream: Any = None, fds: list[int] = ()) -> ImportedMemory:
        """Map/import an allocation; on CUDA ``stream`` waits on the ready event (R1). ``fds``: the
        chunk FDs of a VMM-backed export (owned; closed here), where ``needs_fds`` says so."""

    def needs_fds(self, export: Export) -> bool:
        """Whether importing ``export`` takes its chunk FDs (not for a range of a slab mapped here)."""
        return bool(export.chunks)

    def import_many(self, exports: list[Export], stream: Any = None) -> list[ImportedMemory]:
        """Import a batch whose FDs none needs (on CUDA: set-up once, each ready event waited once)."""
        return [self.import_allocation(e, stream) for e in exports]

    @abstractmethod
    def release(self, memory: ImportedMemory, stream: Any = None, credit: bytes = b"", *,
                if_busy: bool = False) -> bytes:
        """Drop the import (on ``stream``); return the done-event handle for the broker (R2): the
        broker's event ``credit`` (see ``Ordering.credit``) recorded, where one is given and
        an event is needed, else one of our own. ``if_busy``: a release (never a seal, whose event
        readers order after) of a range needs none where the work on ``stream`` is all done."""

    def seal_target(self, memory: ImportedMemory, credit: bytes) -> tuple[Any, Callable[[], Any] | None] | None:
        """For a carved range's seal in one C call with its board post and frame
        (``requests.put_sealed``), made ready before the seal: (what it records on, what to call
        once it is done). The first has ``ptr``, the CUevent of ``credit`` (opened here) as an
        int, 0 where nothing is recorded, and ``handle``, None once it is closed (the caller then
        seals the general way); the second marks ``memory`` released, or is None. None where
        ``seal_range`` or ``release`` must serve."""
        return None

    def stream_int(self, stream: Any) -> int:
        """``stream`` (anything ``release`` takes) as the driver's handle, an int, for a C call; 0
        where there are no streams."""
        return 0

    def seal_range(self, memory: ImportedMemory, stream: Any, credit: bytes, board: Any, word: int, seq: int) -> bool:
        """A carved range's seal in one step where the backend can: ``release`` on the broker's
        ``credit`` (opened here already) and word ``word`` of the seal board ``board`` posted
        (number ``seq``) after the record, in one call (the board's ``post_after(event, stream,
        word, seq)``: a CUevent and a CUstream as ints; 0 done, else nothing done). False where
        nothing was done (the caller releases, then posts)."""
        return False

    def keep(self, memory: ImportedMemory, stream: Any = None, credit: bytes = b"") -> tuple[bytes, Any] | None:
        """Give up the use of ``memory`` as ``release`` does (its done event for the broker, R2),
        but leave it imported here, to be written again when the broker hands the same allocation
        back (a checkpoint's spare): ``(done event, token)``, the token for ``drop_kept``. None
        where keeping saves nothing (an import that costs no more than a lookup); the caller then
        releases it."""
        return None

    def drop_kept(self, memory: ImportedMemory, token: Any) -> None:
        """Drop an import ``keep`` kept, once the work queued on it before ``keep`` has finished."""

    def carved(self, arena: ImportedMemory, offset: int, nbytes: int) -> ImportedMemory:
        """A range of an imported arena (see ``Arenas.carve``), released like any import."""
        raise InvalidRequest("this pool's memory cannot be carved")

    def idle_marker(self, stream: Any = None) -> Any:
        """Something whose ``is_done`` turns true once the work queued on ``stream`` so far has
        finished; None where there is no asynchronous work (the host)."""
        return None

    @abstractmethod
    def close(self) -> None: ...


class ClientBackend(ABC):
    name: str
    array_module = "numpy"   # what ``get_array`` returns (cupy for device memory)
    on_gpu = False           # memory lives on a GPU (torch tensors are made by DLPack)

    def broker_progressed(self) -> None:
        """A reply arrived, so the broker has acted on every earlier message of this session (it
        enqueues its wait on a done event when it reads the message): events named in those
        messages may be recycled (R4)."""

    @abstractmethod
    def import_pool(self, info: dict[str, Any], fd: int) -> ClientPool:
        """Import a pool; takes ownership of ``fd`` (closes it, also on failure)."""

    def import_growable(self, info: dict[str, Any], span: int | None = None) -> ClientGrowable:
        """An empty mapping of a growable buffer; ``extend`` maps its chunks. ``span``: address
        space to reserve for it, where the backend reserves any (None: the backend's default)."""
        raise BackendUnavailable(f"the {self.name} backend has no growable buffers")

    def prepare_growable(self, device: int, span: int | None = None) -> ClientGrowable | None:
        """An empty mapping for a growable of ``device``'s plain memory with its address space
        reserved, made while the broker makes the buffer; ``import_growable`` uses it where the
        buffer is as guessed (``matches``). None where this backend reserves nothing."""
        return None

    maps_loans = False   # maps chunks lent ahead of grows (``broker.loans``): the two below

    def import_loaned(self, device: int, fd: int) -> Any:
        """A lent chunk's handle in this process (``fd`` stays the caller's)."""
        raise BackendUnavailable(f"the {self.name} backend maps no lent chunks")

    def release_loaned(self, device: int, handle: Any) -> None:
        """Release a lent chunk's handle that no buffer took."""

    def read_files(self, jobs: list[tuple[int, int, ImportedMemory, int, int]], stream: Any = None,
                   on_bytes: Callable[[int], None] | None = None) -> None:
        """File bytes into imported memory: each job ``(fd, file_offset, memory, offset, nbytes)``,
        ordered on ``stream`` (host: done on return). ``on_bytes(n)`` reports progress."""
        from .filecopy import read_into_host

        read_into_host(jobs, on_bytes)

    # -- memory of this process's own, for libraries that cannot take pool memory imported from
    # the broker (NIXL/UCX: the fleet's staging, docs/fleet.md)
    def plain_device_memory(self, device: int, nbytes: int) -> Any:
        """``nbytes`` of ``device``'s memory allocated the plain way: from no pool, exported to no
        one. An object with ``ptr``, ``size``, ``device`` and ``close()`` (which frees it)."""
        raise BackendUnavailable(f"the {self.name} backend has no device memory")

    def copy_memory(self, pieces: list[tuple[int, int, int]], device: int | None) -> None:
        """Copy each ``(dst, src, nbytes)`` between addresses this process maps (host memory, or
        ``device``'s and host memory); done when it returns."""
        for dst, src, nbytes in pieces:
            ctypes.memmove(dst, src, nbytes)

    def close(self) -> None:
        """Release backend-wide client resources."""
