"""The sd_notify protocol, without libsystemd: datagrams to $NOTIFY_SOCKET.

READY=1 once the sockets are bound and the pools exist, STATUS= lines, STOPPING=1, and WATCHDOG=1
sent from the event loop at half of $WATCHDOG_USEC, so a wedged loop gets the service restarted.
Outside systemd (no $NOTIFY_SOCKET) every call is a no-op.
"""

from __future__ import annotations

import array
import logging
import os
import socket
import time

log = logging.getLogger(__name__)


class Notifier:
    def __init__(self, environ: dict[str, str] | None = None):
        env = os.environ if environ is None else environ
        path = env.get("NOTIFY_SOCKET", "")
        self._address: str | bytes | None = None
        if path.startswith("@"):
            self._address = b"\0" + path[1:].encode()    # abstract namespace
        elif path.startswith("/"):
            self._address = path
        self._sock: socket.socket | None = None
        if self._address is not None:
            # Non-blocking: a notification must never stall the event loop (a full queue at the
            # receiver would block a send).
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
        self.watchdog_interval = self._watchdog_interval(env)
        self._next_watchdog = 0.0

    @staticmethod
    def _watchdog_interval(env) -> float | None:
        usec = env.get("WATCHDOG_USEC")
        pid = env.get("WATCHDOG_PID")
        if not usec or (pid and pid != str(os.getpid())):
            return None
        try:
            return max(int(usec) / 1e6 / 2, 0.01)
        except ValueError:
            log.warning("ignoring WATCHDOG_USEC=%r: not a number", usec)
            return None

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def notify(self, *lines: str, fds: tuple[int, ...] = ()) -> bool:
        """Send ``KEY=value`` lines (and FDs, for FDSTORE=1). False when not under systemd."""
        if self._sock is None:
            return False
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        try:
            self._sock.sendmsg(["\n".join(lines).encode()], anc, 0, self._address)
            return True
        except BlockingIOError:
            log.warning("sd_notify dropped (the service manager's queue is full): %s", lines[0])
            return False
        except OSError as exc:   # systemd gone: never fatal for the broker
            log.warning("sd_notify failed: %s", exc)
            return False

    def ready(self, status: str) -> None:
        self.notify("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")

    def status(self, status: str) -> None:
        self.notify(f"STATUS={status}")

    def stopping(self) -> None:
        self.notify("STOPPING=1", "STATUS=stopping")

    def tick(self) -> None:
        """Called from every turn of the event loop: a WATCHDOG=1 when one is due."""
        if self.watchdog_interval is None:
            return
        now = time.monotonic()
        if now >= self._next_watchdog:
            self.notify("WATCHDOG=1")
            self._next_watchdog = now + self.watchdog_interval

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
