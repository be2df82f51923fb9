"""Sleeping on a word of shared memory: Linux futexes across processes (FUTEX_WAIT, FUTEX_WAKE).

A directory reader that waits past its spin budget sleeps on its pool directory's change counter
(``shm.directory``), and the broker wakes it when it answers the reader's wake request: one kernel
wake, where an answer over ZeroMQ also crosses the broker's and the reader's I/O threads (on an
H100 host: the same median, most of it CPUs coming back from idle, and a lower p99; see
docs/design.md). The reader maps the directory read-only: FUTEX_WAIT
only reads the word, and the key of a shared mapping is its file and offset, so the broker's
writable mapping of the same memfd wakes it.

Only the low 32 bits of a word are compared (a futex is 32 bits; the layouts are little-endian).
Where the platform has no futex here (``usable`` False), readers sleep on their ZeroMQ socket
instead. Either way the wake only shortens a sleep: a reader looks again after each, and sleeps
at most ``SLICE_S`` at a time, so nothing depends on a wake arriving.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform

_SYSCALL = {"x86_64": 202, "aarch64": 98}.get(platform.machine())   # SYS_futex
_WAIT, _WAKE = 0, 1   # shared (not FUTEX_PRIVATE_FLAG): the word is in memory of several processes
_ALL = 0x7FFFFFFF
SLICE_S = 0.005   # the longest sleep: a reader looks again (and at its socket) after each

usable = _SYSCALL is not None and os.uname().sysname == "Linux"
_libc = ctypes.CDLL(None, use_errno=True) if usable else None


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Buffer(ctypes.Structure):   # Py_buffer, to read a read-only map's address
    _fields_ = [("buf", ctypes.c_void_p), ("obj", ctypes.c_void_p), ("len", ctypes.c_ssize_t),
                ("itemsize", ctypes.c_ssize_t), ("readonly", ctypes.c_int), ("ndim", ctypes.c_int),
                ("format", ctypes.c_char_p), ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
                ("suboffsets", ctypes.c_void_p), ("internal", ctypes.c_void_p)]


def address(mapping, offset: int) -> int:
    """The address of byte ``offset`` of ``mapping`` (an mmap, read-only or not), which stays
    valid while the mapping is open (a futex call on a closed one fails with EFAULT: harmless)."""
    if offset % 4:
        raise ValueError("a futex word is 4-byte aligned")
    view = _Buffer()
    ctypes.pythonapi.PyObject_GetBuffer(ctypes.py_object(mapping), ctypes.byref(view), 0)
    try:
        return view.buf + offset
    finally:
        ctypes.pythonapi.PyBuffer_Release(ctypes.byref(view))


def wait(addr: int, seen: int, timeout_s: float) -> bool:
    """Sleep while the word at ``addr`` still holds the low 32 bits of ``seen``, at most
    ``timeout_s``; returns at once where it moved (a wake, a signal or the timeout also end it).
    False where this kernel cannot sleep on the word (the caller sleeps some other way)."""
    ts = _Timespec(int(timeout_s), int(timeout_s % 1 * 1e9))
    if _libc.syscall(_SYSCALL, ctypes.c_void_p(addr), _WAIT, ctypes.c_uint32(seen & 0xFFFFFFFF),
                     ctypes.byref(ts), None, 0) == 0:
        return True
    return ctypes.get_errno() in _SLEPT


_SLEPT = {errno.EAGAIN, errno.ETIMEDOUT, errno.EINTR}   # the word moved, the time passed, a signal


def wake(addr: int) -> int:
    """Wake every process sleeping on the word at ``addr``; how many were."""
    return _libc.syscall(_SYSCALL, ctypes.c_void_p(addr), _WAKE, _ALL, None, None, 0)
