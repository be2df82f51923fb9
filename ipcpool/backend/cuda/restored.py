"""A pool restored from systemd's FD store after a broker restart: read-only, it keeps the memory
of the objects restored in it."""

from __future__ import annotations

import os
from typing import Any

from ...fds import close_all
from ...errors import ClosedError, InvalidRequest
from ...sizes import HANDLE_BYTES
from ..base import BrokerPool, Export, PoolSpec, PoolStats, SessionContext, Usage


class RestoredCudaPool(Usage, BrokerPool):
    """A pool a previous broker exported, kept from systemd's FD store: the memory of the objects
    restored in it lives on (the FD alone keeps it), clients import it as before, but an imported
    pool cannot allocate (CUDA_ERROR_INVALID_VALUE, seen on an H200), so it is read-only. Its
    memory goes back to the device once the broker and every client have let go of the pool.
    Nothing in it is ordered any more (``NULL_ORDERING``) nor carved (``NO_ARENAS``)."""

    read_only = True

    def __init__(self, spec: PoolSpec, fd: int, info: dict[str, Any]):
        self.spec = spec
        self._fd = fd
        os.set_inheritable(fd, False)
        self.slab_size = int(info.get("slab_size") or 0)
        self._used = 0
        self._high = 0

    @property
    def byte_limit(self) -> int:
        return self.spec.max_size

    @property
    def fd(self) -> int:
        if self._fd < 0:
            raise ClosedError(f"pool {self.spec.name!r} is closed")
        return self._fd

    def pool_info(self) -> dict[str, Any]:
        return {"name": self.spec.name, "device": self.spec.device, "max_size": 0, "peer_access": [],
                "handle_type": "posix_fd", "slab_size": self.slab_size, "read_only": True}

    def allocate(self, nbytes: int, session: SessionContext) -> tuple[object, Export]:
        raise InvalidRequest(f"pool {self.spec.name!r} holds objects restored after a broker restart; "
                             "it cannot allocate (use the configured pool)")

    def restore(self, row: dict[str, Any], fds: list[int]) -> tuple[object, Export]:
        close_all(fds)
        data = bytes(row["data"])
        if len(data) != HANDLE_BYTES or (row.get("sub") and not self.slab_size):
            raise InvalidRequest(f"pool {self.spec.name!r}: a stored object lacks its export data")
        self._used += row["size"]
        self._high = max(self._high, self._used)
        # No ready event: the writer's work ended before the old broker sealed the object.
        return row["size"], Export(size=row["size"], offset=row["offset"], data=data, sub=bool(row.get("sub")))

    def free(self, handle: object, session: SessionContext, done_event: bytes = b"") -> None:
        self._used -= int(handle)   # the memory itself goes with the pool (see the class doc)

    def stats(self) -> PoolStats:
        return PoolStats(reserved=self._used, used=self._used, reserved_high=self._high, used_high=self._high)

    def reset_high(self) -> None:
        self._high = self._used

    def trim(self, keep: int) -> None:
        pass   # nothing is free in it: its memory is released with the pool

    def set_release_threshold(self, nbytes: int) -> None:
        raise InvalidRequest(f"pool {self.spec.name!r} is read-only")

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
