"""FDs owned in one place: ``OwnedFd``, one FD held while something is set up (trio's
``_FdHolder``, cuda.core's ``IPCAllocationHandle``): whoever keeps it ``take()``s the int; anything
left is closed. ``close_all`` for a list of them. A ground module: the backend and the wire use it."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["OwnedFd", "close_all"]


def close_all(fds) -> None:
    """Close every FD in ``fds`` (an iterable of them)."""
    for fd in fds:
        os.close(fd)


class OwnedFd:
    """Owns ``fd`` until ``take()`` hands it on (and forgets it) or ``close()`` closes it. Both set
    ``fd`` to -1, so a second close does nothing and a later take fails loudly. As a context
    manager it closes what was not taken, on success and failure alike: set-up takes the FD as
    its last step, and a failure before that closes it."""

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def take(self) -> int:
        if self.fd < 0:
            raise ValueError("this FD was already taken or closed")
        fd, self.fd = self.fd, -1
        return fd

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)

    def __enter__(self) -> OwnedFd:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
