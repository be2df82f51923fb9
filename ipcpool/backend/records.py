"""The plain data that crosses the backend seam: a pool's spec and stats, an allocation's export,
and the per-session state a backend keeps (``SessionContext``, the host's as it is)."""

from __future__ import annotations

from dataclasses import dataclass, field

# Three reuse policies of a CUDA mempool; the host backend accepts and ignores them.
REUSE_POLICIES = ("follow_event_dependencies", "allow_opportunistic", "allow_internal_dependencies")
SLAB_MEMORY = ("pool", "vmm")   # what a CUDA pool's slabs are: pool allocations, or VMM chunks


@dataclass(frozen=True)
class PoolSpec:
    """A pool as configured. ``max_size`` 0 means the backend's default."""

    name: str
    max_size: int = 0
    release_threshold: int | None = None  # None: keep what was reserved until an explicit trim
    device: int = 0
    reuse: dict[str, bool] = field(default_factory=lambda: dict.fromkeys(REUSE_POLICIES, True))
    peer_access: tuple[int, ...] = ()
    slab_memory: str = "pool"   # what slabs are on CUDA: pool allocations, or "vmm" chunks


@dataclass(frozen=True)
class PoolStats:
    reserved: int
    used: int
    reserved_high: int
    used_high: int

    def as_dict(self) -> dict[str, int]:
        return {
            "reserved": self.reserved,
            "used": self.used,
            "reserved_high": self.reserved_high,
            "used_high": self.used_high,
        }


@dataclass(slots=True)   # made a thousand at a time by a batch attach: kept cheap
class Export:
    """One allocation as it travels to a client.

    ``offset`` locates the memory in what ``data`` names: the pool's mapping on the host, a slab
    when ``sub`` is set (CUDA: a larger allocation the client imports once). ``data`` is the
    64-byte pointer export data (empty on the host); ``ready_event`` the 64-byte IPC handle of an
    event recorded after the allocation (empty where there is nothing to wait for).
    """

    size: int
    offset: int = 0
    data: bytes = b""
    ready_event: bytes = b""
    sub: bool = False
    chunks: tuple[int, ...] = ()   # CUDA VMM: the sizes of the physical chunks whose FDs the
                                   # client fetches over the control socket and maps in order


class SessionContext:
    """Per-session broker state of the backend (a CUDA stream and the events opened for it). A
    backend with no per-session state (the host) uses this class as it is."""

    def peer_progressed(self) -> None:
        """A new message from this session arrived, so the client has acted on every earlier
        reply (it waits on a ready event before it sends again): events named in those replies may
        be recycled (R4)."""

    def peer_gone(self) -> None:
        """The session's process has exited (pidfd), so its GPU work is over: events it named but
        never completed must no longer hold frees back. Call before releasing its memory."""

    def close(self) -> None:
        """Release what the session holds; idempotent."""
