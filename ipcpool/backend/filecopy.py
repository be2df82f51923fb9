"""File bytes into imported memory: the jobs a checkpoint load hands the client backend.

A job is ``(fd, file_offset, memory, offset, nbytes)``. Host memory is read into straight from the
file (no staging copy); the CUDA backend stages through pinned buffers (``cuda.staging``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ..errors import InvalidRequest

PIECE = 64 << 20   # bytes per read: progress moves, and a signal is seen, at least this often

Job = tuple[int, int, Any, int, int]


def read_exact(fd: int, view: memoryview, offset: int) -> None:
    """Fill ``view`` from ``fd`` at ``offset``; a file that ends early is an error."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise InvalidRequest(f"the file ended {len(view) - done} bytes early (at {offset + done})")
        done += got


def read_into_host(jobs: list[Job], on_bytes: Callable[[int], None] | None) -> None:
    for fd, file_offset, memory, offset, nbytes in jobs:
        if memory.view is None:
            raise InvalidRequest("host reads need host memory")
        for at in range(0, nbytes, PIECE):
            n = min(PIECE, nbytes - at)
            read_exact(fd, memory.view[offset + at : offset + at + n], file_offset + at)
            if on_bytes is not None:
                on_bytes(n)
