"""Open files: the broker takes the hard limit, keeps a reserve free, and guards the message channel.

A new session takes three files (its control socket, its pidfd, its ZeroMQ connection), and
libzmq aborts the process when it cannot get one it needs. libzmq accepts message-channel
connections on its own thread, from anyone who can reach the socket file, and accept() finding
no free file (EMFILE) is such a case. Its monitor tells us of each connection (by FD), so the
listener is closed before that can happen: when files run short, or connections without a
session take a quarter of the files still free. Closing it cuts every connection made through it,
sessions' included, so connections that are merely many (100 bare ZeroMQ peers against a limit of
20,000) are counted and logged, never a reason.
"""

from __future__ import annotations

import logging
import os
import resource
import struct
import time

import zmq

from .sessions import Sessions

log = logging.getLogger(__name__)

FD_RESERVE_MIN = 64   # open files kept free (at least)
STRAY_ZMQ = 64        # message-channel connections beyond one per session before they are logged


def raise_fd_limit() -> tuple[int, int]:
    """Take the hard limit of open files as ours (a broker serves many clients); returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, want, exc)
    return soft, hard


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


class FdGuard:
    def __init__(self, router: zmq.Socket, monitor: zmq.Socket, endpoint: str, fd_limit: int, sessions: Sessions):
        self.router = router
        self.monitor = monitor     # the router's, for EVENT_ACCEPTED and EVENT_DISCONNECTED
        self.endpoint = endpoint
        self.fd_limit = fd_limit
        self.sessions = sessions
        self.zmq_open = True        # the message channel's listener accepts (closed while files run short)
        self._fd_count = 0          # open files when last counted,
        self._zmq_at_count = 0      # ... and message-channel connections then
        self._counted_at = 0.0
        self._zmq_fds: set[int] = set()   # the message channel's connections (from its monitor)
        self._stray_said = 0.0      # when connections without a session were last logged
        self._session_peak = 0      # the most sessions lately (clients that just closed may still
        self._peak_at = 0.0         # ... be connected on the message channel a moment)

    def reserve(self) -> int:
        return max(FD_RESERVE_MIN, self.fd_limit // 32)

    def room(self) -> int:
        """Open files left before the limit (counted: chunk and pool FDs come and go too)."""
        if not self.fd_limit:
            return 1 << 30
        self._fd_count, self._zmq_at_count, self._counted_at = open_fds(), len(self._zmq_fds), time.monotonic()
        return self.fd_limit - self._fd_count

    def session_opened(self) -> None:
        self._session_peak = max(self._session_peak, len(self.sessions.by_token))

    def recount(self) -> None:
        """A recount now and then (monitor events may be missed): often while the listener is closed."""
        if time.monotonic() - self._counted_at > (0.2 if not self.zmq_open else 2.0):
            self._check(self.room())

    def on_monitor(self) -> None:
        """Follow the message channel's connections; close its listener when they outnumber the
        sessions by more than STRAY_ZMQ (connections nobody will use), or files run short."""
        for _ in range(10_000):
            try:
                frames = self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames[0]) >= 6:
                event, fd = struct.unpack_from("=Hi", frames[0])
                if event == zmq.EVENT_ACCEPTED:
                    self._zmq_fds.add(fd)
                elif event == zmq.EVENT_DISCONNECTED:
                    self._zmq_fds.discard(fd)
        if self.zmq_open:
            estimate = self._fd_count + len(self._zmq_fds) - self._zmq_at_count
            if self.fd_limit and (self.fd_limit - estimate < self.reserve() or self._strays_threaten(estimate)):
                self._check(self.room())
            stray = self._stray_zmq()
            if stray > STRAY_ZMQ and time.monotonic() - self._stray_said > 10.0:
                self._stray_said = time.monotonic()
                log.warning("%d message-channel connections without a session (%d sessions)", stray,
                            len(self.sessions.by_token))

    def _strays_threaten(self, in_use: int) -> bool:
        """Connections without a session that take a quarter of the files still free: libzmq
        accepts on its own thread, faster than we hear of it, so a flood that size may reach the
        limit before the next look. (100 of them against a limit of 20,000 never do.)"""
        return self._stray_zmq() > max(STRAY_ZMQ, (self.fd_limit - in_use) // 4)

    def _stray_zmq(self) -> int:
        """Message-channel connections beyond one per session (or session about to be, or that
        ended in the last two seconds)."""
        now = time.monotonic()
        sessions = len(self.sessions.by_token)
        if now - self._peak_at > 2.0:
            self._session_peak, self._peak_at = sessions, now
        return len(self._zmq_fds) - max(self._session_peak, sessions) - len(self.sessions.pending)

    def _check(self, room: int) -> None:
        """Close the message channel's listener when fewer than half the reserve of files is left
        (the last resort before libzmq aborts: it drops the connections it accepted there; clients
        reconnect by themselves; a request in flight may be lost). Open it again once the whole
        reserve is free. Meanwhile new sessions are refused (BrokerBusy)."""
        reserve = self.reserve()
        if self.zmq_open and (room < reserve // 2 or self._strays_threaten(self._fd_count)):
            log.warning("message channel closed to new connections: %d connections for %d sessions, "
                        "%d of %d open files in use", len(self._zmq_fds), len(self.sessions.by_token),
                        self._fd_count, self.fd_limit)
            self.router.unbind(self.endpoint)
            self._zmq_fds.clear()   # libzmq drops them all (and says nothing of each)
            self.zmq_open = False
        elif not self.zmq_open and room >= reserve and self._stray_zmq() <= STRAY_ZMQ // 2:
            old = os.umask(0o117)
            try:
                self.router.bind(self.endpoint)
            finally:
                os.umask(old)
            self.zmq_open = True
            log.warning("message channel open to new connections again (%d of %d open files in use)",
                        self._fd_count, self.fd_limit)
