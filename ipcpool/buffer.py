"""What a client holds: ``Buffer`` (an allocation, an object being written, or a lease) and
``Subscription`` (seals announced under a prefix). Both act through the client that made them."""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any

from . import interop
from .backend.base import ImportedMemory
from .errors import ClosedError, InvalidRequest

if TYPE_CHECKING:
    from .client import Client


class Buffer:
    """Memory from the broker. Free it (or use ``with``); the client frees leftovers on close."""

    def __init__(self, client: Client, alloc_id: int, pool: str, memory: ImportedMemory, owner: bool,
                 *, name: str | None = None, meta: dict | None = None, readonly: bool = False):
        self._client = client
        self.alloc_id = alloc_id
        self.pool = pool
        self._memory = memory
        self.owner = owner
        self.name = name
        self.meta = meta or {}
        self.readonly = readonly
        self._freed = False
        # Carved from this client's arena and requested without waiting (``handoff.Carving``).
        self._carving = None

    def _live(self) -> ImportedMemory:
        if self._freed:
            raise ClosedError("this buffer was freed")
        return self._memory

    @property
    def size(self) -> int:
        return self._memory.size

    @property
    def ptr(self) -> int:
        return self._live().ptr

    @property
    def device(self) -> int | None:
        return self._memory.device

    @property
    def view(self) -> memoryview:
        """A writable memoryview (host backend)."""
        view = self._live().view
        if view is None:
            raise AttributeError("view: only host-backend buffers are CPU-addressable; use DLPack")
        return view.toreadonly() if self.readonly else view

    @property
    def __array_interface__(self) -> dict:
        mem = self._live()
        if mem.view is None:
            raise AttributeError("__array_interface__: not host memory")
        return {"version": 3, "shape": (mem.size,), "typestr": "|u1", "data": (mem.ptr, self.readonly)}

    @property
    def __cuda_array_interface__(self) -> dict:
        cai = self._live().cuda_array_interface
        if cai is None:
            raise AttributeError("__cuda_array_interface__: not CUDA memory")
        # A lease is read-only by contract; the flag stays False because torch refuses any other
        # ("the read only flag is not supported"), as CuPy ignores it.
        return cai

    def __dlpack__(self, **kwargs):
        return self._live().dlpack(**kwargs)

    def __dlpack_device__(self):
        return self._live().dlpack_device()

    def tensor(self) -> Any:
        """This buffer as a torch tensor, zero-copy: its metadata's dtype and shape, else its
        bytes (uint8). On CUDA a slab range is a view of one tensor kept per slab: a few µs, where
        ``torch.from_dlpack`` builds a fresh import each call. Work on it goes on torch's current
        stream: the one given to ``create``/``get`` (or ordered after it by the caller)."""
        self._live()
        return interop.as_tensor(self._client, self)

    def share(self) -> bytes:
        """A token another session passes to ``Client.open`` to use this memory too. The broker
        frees the memory only once the owner and every opener have freed it."""
        self._live()
        return self._client.share(self)

    def free(self, stream: Any = None) -> None:
        """Give the memory back (on CUDA: released on ``stream``, freed by the broker after)."""
        if self._freed:
            return
        self._freed = True
        self._client._free(self, stream)

    close = release = free

    def seal(self, stream: Any = None) -> None:
        """Finish writing a named object: after the work on ``stream``, it is immutable and readers
        may have it. This buffer is given up (``get`` the object to read it again)."""
        if self.name is None or self.readonly:
            raise InvalidRequest("only a buffer from Client.create() can be sealed")
        self._live()
        self._freed = True
        self._client._seal(self, stream)

    def write(self, data, offset: int = 0, stream: Any = None) -> None:
        """Copy host bytes into this buffer at ``offset`` (on CUDA, ordered on ``stream``)."""
        mem = self._live()
        if self.readonly:
            raise InvalidRequest("this buffer is a read-only lease")
        src = memoryview(data).cast("B")
        if offset < 0 or offset + src.nbytes > mem.size:
            raise ValueError(f"{src.nbytes} bytes at offset {offset} do not fit in {mem.size}")
        mem.copy_from_host(src, offset, self._client._backend, stream)

    @property
    def freed(self) -> bool:
        return self._freed

    @property
    def carved_at(self) -> tuple[int, int] | None:
        """(arena id, offset) for an object carved from this client's arena (created without a
        round trip), else None."""
        return None if self._carving is None else (self._carving.arena.aid, self._carving.offset)

    def __enter__(self) -> Buffer:
        return self

    def __exit__(self, *exc) -> None:
        self.free()

    def __repr__(self) -> str:
        what = f"object {self.name!r}" if self.name else "buffer"
        return f"<ipcpool.Buffer {what} {self.size} bytes from {self.pool!r}{' (freed)' if self._freed else ''}>"


class Subscription:
    """Objects sealed under a prefix, as they are sealed: ``for info in sub`` or ``sub.next(t)``."""

    def __init__(self, client: Client, wid: int, prefix: str, queue: collections.deque):
        self._client = client
        self.wid = wid
        self.prefix = prefix
        self._queue = queue

    def next(self, timeout: float | None = None) -> dict | None:
        """The next sealed object's info (name, size, meta, ...), or None after ``timeout`` s."""
        return self._client._next_event(self.wid, timeout)

    def __iter__(self):
        while True:
            yield self.next()

    def close(self) -> None:
        self._client._unwatch(self.wid)

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
