"""The control socket's framing: one msgpack message per SOCK_SEQPACKET datagram, FDs by SCM_RIGHTS.

SEQPACKET keeps message boundaries, so there is no length read from the wire to trust; an oversized
message is cut by the kernel and reported with MSG_TRUNC. FDs received alongside a message that
fails any check are closed before the error is raised, so a bad peer cannot leak FDs into us.
"""

from __future__ import annotations

import array
import ctypes
import errno
import fcntl
import functools
import os
import resource
import socket
import struct
from dataclasses import dataclass

from . import protocol
from .errors import ProtocolError
from .fds import close_all

_UCRED = struct.Struct("3i")
# Linux >= 6.5: a pidfd for the peer, taken at connect time (no pid-reuse race).
SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)
MAX_FDS = protocol.FD_BATCH   # the most FDs one control message carries
# Linux >= 4.13: the peer's supplementary groups, as they were at connect time.
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
NGROUPS_MAX = 65536
# Plain ints: recvmsg's flags are an int, and an int & socket.MsgFlag goes through the enum
# machinery (microseconds on every message of a hot path).
_CTRUNC, _TRUNC = int(socket.MSG_CTRUNC), int(socket.MSG_TRUNC)
_FD_SIZE = array.array("i").itemsize


@dataclass(frozen=True)
class PeerCred:
    pid: int
    uid: int
    gid: int


def peer_cred(sock: socket.socket) -> PeerCred:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    return PeerCred(*_UCRED.unpack(raw))


def peer_groups(sock: socket.socket) -> tuple[int, ...]:
    """The peer's supplementary group ids (SO_PEERGROUPS); () where the kernel does not say."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 1024)   # (Python's most: 256 groups)
    except OSError as exc:
        if exc.errno != errno.ERANGE:
            return ()
        raw = _getsockopt(sock.fileno(), socket.SOL_SOCKET, SO_PEERGROUPS, 4 * NGROUPS_MAX)
    arr = array.array("I")
    arr.frombytes(raw[: len(raw) - len(raw) % arr.itemsize])
    return tuple(arr)


def _getsockopt(fd: int, level: int, opt: int, size: int) -> bytes:
    """getsockopt with a buffer larger than Python's socket.getsockopt allows."""
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(size)
    length = ctypes.c_uint32(size)
    if libc.getsockopt(fd, level, opt, buf, ctypes.byref(length)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return buf.raw[: length.value]


def presize_table(fd: int, entries: int) -> int:
    """Grow this process's table of open files to ``entries`` slots now (at most RLIMIT_NOFILE's
    soft limit), by a duplicate of ``fd`` at the top, closed at once; returns the slots asked for.

    The kernel grows the table by doubling when a new FD does not fit it (64, 128, 256 ...), and in
    a process of several threads each growth waits for an RCU grace period: 4 to 24 ms measured
    on an H100 host, paid by whichever call opened the FD. A client's first reply with chunk FDs
    took 6 to 7.5 ms for it instead of 1. Sized at connect (the broker: at start) it costs that
    once, off every request's path (nothing when no other thread runs yet); a table never shrinks."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY:
        entries = min(entries, soft)
    try:
        os.close(fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, entries - 1))   # the lowest free FD from there
    except OSError:   # EMFILE, EINVAL: the table stays as it is (it grows when it must)
        pass
    return entries


def peer_pidfd(sock: socket.socket, pid: int) -> int:
    """A pidfd for the peer process: SO_PEERPIDFD where the kernel has it, else pidfd_open."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD, 4)
        return struct.unpack("i", raw)[0]
    except OSError:
        return os.pidfd_open(pid)


def send(sock: socket.socket, msg: dict, fds: tuple[int, ...] = ()) -> None:
    data = protocol.pack(msg)
    if len(data) > protocol.MAX_MESSAGE:
        raise ProtocolError(f"message of {len(data)} bytes exceeds the limit of {protocol.MAX_MESSAGE}")
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sock.sendmsg([data], anc)


@functools.cache
def _cmsg_space(max_fds: int) -> int:
    return socket.CMSG_SPACE(max_fds * _FD_SIZE)


def recv(sock: socket.socket, max_fds: int = MAX_FDS) -> tuple[dict, list[int]] | None:
    """Receive one message and its FDs; None on EOF. The caller owns the returned FDs."""
    got = recv_raw(sock, max_fds)
    if got is None:
        return None
    try:
        return protocol.unpack(got[0]), got[1]
    except BaseException:
        close_all(got[1])
        raise


def recv_raw(sock: socket.socket, max_fds: int = MAX_FDS) -> tuple[bytes, list[int]] | None:
    """One message's bytes, undecoded, and its FDs; None on EOF."""
    data, anc, flags, _ = sock.recvmsg(protocol.MAX_MESSAGE + 1, _cmsg_space(max_fds))
    fds: list[int] = []
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            arr = array.array("i")
            arr.frombytes(payload[: len(payload) - len(payload) % arr.itemsize])
            fds.extend(arr)
    try:
        if flags & _CTRUNC:
            raise ProtocolError(f"too many file descriptors in one message (at most {max_fds})")
        if flags & _TRUNC or len(data) > protocol.MAX_MESSAGE:
            raise ProtocolError(f"message exceeds the limit of {protocol.MAX_MESSAGE} bytes")
        if not data and not fds:
            return None
        return data, fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
