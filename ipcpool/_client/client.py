"""What a worker imports: ``connect()``, ``Client.allocate``, ``Buffer``.

``Client`` is the face of a session; the work is done by its parts (see ``ipcpool._client``),
which it makes when it connects and to which each method hands over. The parts never call back
into the facade.
"""

from __future__ import annotations

import logging
import os
from typing import Any, NamedTuple

from .. import paths
from ..backend import client_backend
from ..backend.base import ClientBackend
from ..errors import IpcPoolError
from . import gcpause, interop
from .catalog import Subscription, list_all, subscribe
from .channel import Channel
from .checkpoints import Checkpoint, Checkpoints, VersionWriter, wait_attach
from .growables import GrowableBuffer, Growables, Remap
from .leases import Buffer, Leases
from .pools import Pools
from .settings import Settings

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 30.0


def connect(socket_dir: str | os.PathLike | None = None, *, timeout: float = DEFAULT_TIMEOUT,
            arena_bytes: int | None = None) -> Client:
    """Open a session with the broker serving ``socket_dir`` (default: see ``paths``).
    ``arena_bytes``: the size of the arenas small objects are carved from without a round trip
    (default ``IPCPOOL_ARENA_BYTES`` or 32 MiB; 0: every create waits for the broker).

    Spinning, read here from the environment: a reply is polled for ``IPCPOOL_CLIENT_SPIN_US``
    (300) before sleeping, an object or its seal a ``get`` waits for ``IPCPOOL_GET_SPIN_US``
    (1000, then as long again while the broker is asked to wake it), a pending seal event
    ``IPCPOOL_EVENT_SPIN_US`` (2000, CUDA) before a stream wait; waking a sleeping process costs
    tens to hundreds of µs each time. ``IPCPOOL_CLIENT_SPIN_US=0`` turns the first two off."""
    return Client(socket_dir, timeout=timeout, arena_bytes=arena_bytes)



class ClientParts(NamedTuple):
    backend: ClientBackend       # the client side of the broker's backend (GPU or host memory, copies)
    checkpoints: Checkpoints     # the client's checkpoint table (begin, attach, publish)

class Client:
    def __init__(self, socket_dir: str | os.PathLike | None = None, *, timeout: float = DEFAULT_TIMEOUT,
                 arena_bytes: int | None = None):
        self.socket_dir = paths.resolve(socket_dir)
        settings = Settings.from_env(arena_bytes)
        self._channel = channel = Channel(self.socket_dir, timeout, settings)
        self.session = channel.session
        self.backend_name = channel.backend_name
        self.pool_names = channel.pool_names
        try:
            self._backend = client_backend(self.backend_name)
        except BaseException:
            channel.close()
            raise
        self._pools = Pools(channel, self._backend)
        self._leases = Leases(channel, self._pools, self._backend, settings.arena_bytes)
        self._handoff = self._leases.handoff
        self._growables = Growables(channel, self._backend, settings.growable_span)
        self._checkpoints = Checkpoints(channel, self._leases)
        # What arrives unasked, and the replies to requests sent without waiting, go to the parts.
        channel.on_reply, channel.on_notice = self._handoff.on_reply, self._handoff.on_notice
        channel.on_grown = self._growables.on_grown
        channel.on_progress = self._backend.broker_progressed

    @property
    def parts(self) -> ClientParts:
        """The client's backend and checkpoint table, for the modules that extend it
        (``ipcpool.weights``, ``ipcpool.fleet``: loaded only when used); not for applications."""
        return ClientParts(self._backend, self._checkpoints)

    # -- settings the channel reads on every request --------------------------------------------
    @property
    def timeout(self) -> float:
        """Seconds a request waits for the broker's answer (a ``get`` waits its own timeout more)."""
        return self._channel.timeout

    @timeout.setter
    def timeout(self, value: float) -> None:
        self._channel.timeout = value

    @property
    def spin_s(self) -> float:
        """Seconds a reply is polled for before sleeping (``IPCPOOL_CLIENT_SPIN_US``)."""
        return self._channel.spin_s

    @spin_s.setter
    def spin_s(self, value: float) -> None:
        self._channel.spin_s = value

    @property
    def async_errors(self) -> list[IpcPoolError]:
        """What the broker refused of the requests sent without waiting, in the order it came."""
        return self._channel.async_errors

    @async_errors.setter
    def async_errors(self, value: list[IpcPoolError]) -> None:
        self._channel.async_errors = value

    @property
    def arena_bytes(self) -> int:
        return self._handoff.arena_bytes

    # -- anonymous allocations --------------------------------------------------------------------
    def flush(self) -> None:
        """Wait until the broker has answered every request this client sent without waiting
        (carved creates and allocations, seals); raise the first it refused."""
        with self._channel.lock:
            self._channel.check_open()
            self._handoff.flush()

    def allocate(self, nbytes: int, *, pool: str = "default", stream: Any = None) -> Buffer:
        """Allocate ``nbytes`` from the broker's pool ``pool``; on CUDA, ``stream`` waits for it."""
        return self._leases.allocate(nbytes, pool, stream)

    def open(self, token: bytes, *, stream: Any = None) -> Buffer:
        """Open an allocation another session shared with ``Buffer.share()``."""
        return self._leases.open(token, stream)

    # -- named objects --------------------------------------------------------------------------
    def create(self, name: str, nbytes: int, *, pool: str = "default", meta: dict | None = None,
               stream: Any = None) -> Buffer:
        """A new named object, writable by this client alone until ``Buffer.seal()``.

        An object of up to a quarter of an arena (``arena_bytes``) is carved from this client's
        arena without waiting for the broker: its refusal (a name another session uses, the
        objects quota) is then raised by ``seal()`` (or ``free()``), and nothing is lost. Larger
        objects wait for the broker, and a refusal is raised here."""
        return self._leases.create(name, nbytes, pool, meta, stream)

    def get(self, name: str, *, stream: Any = None, timeout: float | None = None) -> Buffer:
        """A read lease on object ``name``; on CUDA ``stream`` waits for the seal. Blocks until the
        object is sealed, or ``timeout`` seconds pass (WaitTimeout); ``timeout=0`` never waits."""
        lease = self._leases.get(name, stream, timeout)
        try:
            lease.memory.ready()   # (as ``_ready``, for one: no list on the hand-off's path)
        except BaseException:
            lease.free(stream)
            raise
        return lease

    def get_many(self, names: list[str], *, stream: Any = None) -> list[Buffer]:
        """Read leases on many sealed objects in one request (all or none; no waiting): how a
        restarted worker attaches to its weights."""
        with gcpause.paused():
            return _ready(self._leases.get_many(names, stream), stream)

    def release(self, lease: Buffer, stream: Any = None) -> None:
        """Let go of a lease (the same as ``lease.release(stream)``)."""
        lease.free(stream)

    def delete(self, name: str) -> None:
        """Remove ``name``; its memory is freed once the last lease is released."""
        self._channel.call("delete", name=name)

    def list(self, prefix: str = "") -> list[dict]:
        """Objects whose name starts with ``prefix``: name, size, pool, state, leases, meta."""
        return list_all(self._channel, prefix, "objects")

    def subscribe(self, prefix: str = "", *, existing: bool = False) -> Subscription:
        """Be told of each object sealed under ``prefix`` (and, with ``existing``, those sealed
        already), without polling the broker."""
        return subscribe(self._channel, prefix, existing)

    # -- tensors and arrays (torch, CuPy, numpy: imported only when used) -------------------------
    def put_tensor(self, name: str, tensor: Any, *, pool: str = "default", stream: Any = None,
                   user: dict | None = None) -> None:
        """Store a torch tensor, CuPy or numpy array as a new sealed object (dtype and shape kept)."""
        interop.put(self, name, tensor, on_gpu=self._backend.on_gpu, pool=pool, stream=stream, user=user)

    def get_tensor(self, name: str, *, stream: Any = None, timeout: float | None = None) -> Any:
        """Object ``name`` as a torch tensor, zero-copy. The lease lasts until ``release_all(name)``
        or close."""
        return self._leases.typed(self._leases.get(name, stream, timeout), "torch")

    def get_tensors(self, names: list[str], *, stream: Any = None) -> dict[str, Any]:
        """Many objects as torch tensors by name, with one request (``get_many``): how a
        restarted worker attaches to its weights. Leases last until ``release_all`` or close."""
        with gcpause.paused():
            return self._leases.typed_many(self._leases.get_many(names, stream), "torch")

    def get_arrays(self, names: list[str], *, stream: Any = None) -> dict[str, Any]:
        """Many objects as CuPy arrays (CUDA) or numpy arrays (host) by name, in one request."""
        with gcpause.paused():
            return self._leases.typed_many(self._leases.get_many(names, stream), self._backend.array_module)

    def get_array(self, name: str, *, stream: Any = None, timeout: float | None = None) -> Any:
        """Object ``name`` as a CuPy array (CUDA backend) or numpy array (host backend), zero-copy."""
        return self._leases.typed(self._leases.get(name, stream, timeout), self._backend.array_module)

    def release_all(self, name: str, stream: Any = None) -> int:
        """Release every lease this client holds on ``name``; returns how many."""
        return self._leases.release_all(name, stream)

    # -- growable buffers -------------------------------------------------------------------------
    def create_growable(self, name: str, nbytes: int, *, pool: str = "default",
                        compression: bool = False) -> GrowableBuffer:
        """A new named buffer of at least ``nbytes`` on ``pool``'s device that can grow without
        copying (``GrowableBuffer.grow``). ``compression``: ask for compressible memory where the
        device offers it; ``GrowableBuffer.compression`` says what was obtained."""
        return self._growables.create(name, nbytes, pool, compression)

    def attach_growable(self, name: str) -> GrowableBuffer:
        """Map an existing growable buffer; it follows every later grow (``GrowableBuffer.sync``)."""
        return self._growables.attach(name)

    def grow(self, name: str, nbytes: int) -> Remap:
        """Grow the attached buffer ``name`` (the same as ``GrowableBuffer.grow``)."""
        return self._growables.grow_named(name, nbytes)

    def list_growables(self, prefix: str = "") -> list[dict]:
        """Growable buffers: name, pool, size, chunks, attached sessions, state, generation."""
        return list_all(self._channel, prefix, "growables")

    def delete_growable(self, name: str) -> None:
        """Delete a growable buffer; its memory goes once every attached client has closed it."""
        self._growables.delete(name)

    # -- checkpoints (model weights: a name -> versions, each published whole) ---------------------
    def attach(self, name: str, *, version: int | None = None, kind: str = "torch", stream: Any = None,
               timeout: float | None = 0) -> Checkpoint:
        """Checkpoint ``name``'s current version (or ``version``) as zero-copy tensors in one call:
        ``ckpt.tensors`` (``kind``: torch, numpy or cupy), ``ckpt.version``, ``ckpt.refresh()``
        to move to the newest, ``ckpt.release()`` (or ``with``). ``timeout``: seconds to wait for
        a first version (None: for ever; 0: not at all)."""
        return wait_attach(self._checkpoints, name, version, kind, stream, timeout)

    def new_version(self, name: str, tensors: list, *, pool: str = "default", user: dict | None = None,
                    shard_bytes: int | None = None, stream: Any = None) -> VersionWriter:
        """A version of checkpoint ``name`` to fill: ``tensors`` lists ``TensorSpec``s (or
        ``(name, dtype, shape)``). Write through ``w.tensors()``, then ``w.publish(stream)``; a
        ``with`` block left without publishing drops it. ``w.ranges()``: its memory, shard by shard."""
        from ..weights.layout import DEFAULT_SHARD_BYTES, TensorSpec, plan

        specs = [t if isinstance(t, TensorSpec) else TensorSpec(t[0], str(t[1]), tuple(t[2])) for t in tensors]
        shards, entries = plan(specs, shard_bytes or DEFAULT_SHARD_BYTES)
        return self._checkpoints.begin(name, shards, entries, pool=pool, user=user, exclusive=False, stream=stream)

    def new_version_like(self, name: str, shard_sizes: list[int], entries: list, *, pool: str = "default",
                         user: dict | None = None, stream: Any = None) -> VersionWriter:
        """A version laid out exactly as given (``Entry``s and shard sizes, e.g. another broker's
        ``Checkpoint.entries`` and ``shard_sizes``): a pull copies shard for shard, byte for byte."""
        return self._checkpoints.begin(name, list(shard_sizes), list(entries), pool=pool, user=user,
                                       exclusive=False, stream=stream)

    def publish_tensors(self, name: str, tensors: Any, *, pool: str = "default", stream: Any = None,
                        user: dict | None = None) -> int:
        """A new version of ``name`` copied from live torch tensors (device to device on CUDA),
        current once the copies are done; returns its number."""
        from ..weights.modules import publish_tensors

        return publish_tensors(self, name, tensors, pool=pool, stream=stream, user=user)

    def load_checkpoint(self, name: str, path: Any, *, pool: str = "default", progress: bool = True,
                        stream: Any = None) -> int:
        """A new version of ``name`` from a safetensors file or a sharded directory; its number."""
        from ..weights.load import load_checkpoint

        return load_checkpoint(self, name, path, pool=pool, progress=progress, stream=stream)

    def load_or_attach(self, name: str, path: Any, *, pool: str = "default", kind: str = "torch",
                       timeout: float | None = None, progress: bool = False, stream: Any = None) -> Checkpoint:
        """Attach ``name``, loading it from ``path`` first where no one has: of many callers one
        loads, the others wait and attach; a loader that dies is replaced by the next caller."""
        from ..weights.load import load_or_attach

        return load_or_attach(self, name, path, pool=pool, kind=kind, timeout=timeout, progress=progress,
                              stream=stream)

    def list_checkpoints(self, prefix: str = "") -> list[dict]:
        """Checkpoints: name, current version, and each live version (state, tensors, size,
        shards, holders)."""
        return self._checkpoints.list(prefix)

    def delete_checkpoint(self, name: str) -> None:
        """Forget ``name``: versions go once their readers release them."""
        self._checkpoints.delete(name)

    # -- sharing and administration ---------------------------------------------------------------
    def share(self, buf: Buffer) -> bytes:
        return self._leases.share(buf)

    def stats(self) -> dict:
        """Per-pool ``reserved``, ``used``, ``reserved_high``, ``used_high``; ``sessions``."""
        reply = self._channel.call("stats")
        reply.pop("id"), reply.pop("ok")
        return reply

    def sessions(self) -> list[dict]:
        """The broker's open sessions: ``session``, ``pid``, ``uid``, ``gid``, ``bytes`` it keeps
        alive (its arenas included), ``arena_bytes``, ``allocations``, ``leases`` on objects,
        objects it is ``writing``, ``growables`` attached, ``state`` (open, or orphaned: its
        socket closed, its process not gone yet)."""
        out: list[dict] = []
        while True:
            reply = self._channel.call("sessions", after=out[-1]["session"] if out else 0)
            out += reply["sessions"]
            if not reply.get("more") or not reply["sessions"]:
                return out

    def reset_high(self, pool: str | None = None) -> None:
        self._channel.call("reset_high", **({"pool": pool} if pool else {}))

    def trim(self, pool: str, keep: int = 0) -> None:
        self._channel.call("trim", pool=pool, keep=keep)

    def set_release_threshold(self, pool: str, nbytes: int) -> None:
        self._channel.call("set_release_threshold", pool=pool, bytes=nbytes)

    @property
    def backend(self) -> str:
        return self.backend_name

    # -- closing ------------------------------------------------------------------------------
    def close(self) -> None:
        """Free what is still held (in order: our imports first), say bye, close. Idempotent.

        Every request sent without waiting is answered before the bye's answer, so a refusal
        nobody has raised yet (a carved create of a name that exists, say) is raised here, once
        the session is closed: nothing the broker refused is lost without a word."""
        channel = self._channel
        with channel.lock:
            if channel.closed:
                return
            try:
                self._checkpoints.close()   # kept imports first (the bye lets the broker's holds go)
                self._leases.free_all()
                self._growables.close_all()
                channel.call("bye")
            except IpcPoolError as exc:
                log.info("closing a session whose broker is gone: %s", exc)
            finally:
                channel.close()
                self._leases.views.clear()   # (views of slabs: before the pools go)
                self._pools.close()
                self._backend.close()
            channel.raise_unraised()

    @property
    def closed(self) -> bool:
        return self._channel.closed

    def __enter__(self) -> Client:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:   # the block's own error goes on; a refusal found while closing is logged beside it
            self.close()
        except IpcPoolError as refusal:
            log.error("while closing after %s: %s", exc_type.__name__, refusal)
            exc.add_note(f"ipcpool: closing the client also found: {refusal!r}")

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"session {self.session}"
        return f"<ipcpool.Client {self.backend_name} {self.socket_dir} {state}>"


def _ready(leases: list[Buffer], stream: Any) -> list[Buffer]:
    """Leases whose memory is imported, every one (a CUDA slab may still be importing in the
    background); on a failure all are freed and it is raised. get_tensors needs no such wait:
    its views wait for each slab as they reach it, and free all on a failure."""
    try:
        for lease in leases:
            lease.memory.ready()
    except BaseException:
        for lease in leases:
            if not lease.freed:
                lease.free(stream)
        raise
    return leases

