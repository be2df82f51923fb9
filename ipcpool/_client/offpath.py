"""Work a client does off its caller's path: one thread of the client's own.

A steady writer's next carve (its range, board word, credit, buffer and tensor view: ~25 µs on an
H100 host) is made ready after each seal. Made in ``seal`` itself, the caller waits for it; made
here, ``seal`` returns once its frame is sent and the carve is made while the caller does other
work (or waits on I/O, which lets this thread run). A create that comes before it is made carves
as usual, so nothing waits on this thread; it takes the client's lock for each piece of work, as
the caller's own calls do.

Asking costs a queue put (~0.2 µs). The thread starts at the first ask and ends at ``close``. In a
process forked from the one that started it (the thread is not copied), work runs inline.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class OffPath:
    """One daemon thread that runs what it is asked, each under ``lock``, in order."""

    def __init__(self, lock: Any, name: str = "ipcpool-offpath"):
        self._lock = lock
        self._name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._pid = 0        # the process whose thread it is
        self._closed = False

    def ask(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the thread (inline where it cannot be: closed, or a forked child)."""
        if self._closed or (self._pid != _pid and not self._start()):
            with self._lock:
                fn(*args)
            return
        self._queue.put((fn, args))

    def _start(self) -> bool:
        if self._thread is not None:   # (started in the process this one was forked from)
            return False
        t = threading.Thread(target=_serve, args=(self._queue, self._lock), name=self._name, daemon=True)
        t.start()
        self._thread, self._pid = t, _pid
        weakref.finalize(self, self._queue.put, None)   # (dropped without close: the thread ends too)
        return True

    def close(self, wait: float | None = 5.0) -> None:
        """No more work: what was asked runs, then the thread ends (waited for up to ``wait``
        seconds, never by the thread itself nor while holding the lock its work takes)."""
        self._closed = True
        t = self._thread
        if t is None or self._pid != _pid:
            return
        self._queue.put(None)
        if wait and t is not threading.current_thread() and not _holds(self._lock):
            t.join(wait)

    def wait(self, timeout: float = 5.0) -> bool:
        """Until what was asked so far has run (False: not within ``timeout`` seconds). Not while
        holding the lock its work takes."""
        if not self.running:
            return True
        done = threading.Event()
        self._queue.put((done.set, ()))
        return done.wait(timeout)

    @property
    def running(self) -> bool:
        t = self._thread
        return t is not None and self._pid == _pid and t.is_alive()


# This process's id, kept here: ``os.getpid`` is a system call (~0.9 µs after a sleep on a 2-CPU
# host), and ``ask`` runs on each seal.
_pid = os.getpid()


def _forked() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_forked)


def _serve(work: queue.SimpleQueue, lock: Any) -> None:
    # (holds neither the client nor its hand-off between pieces of work: a client dropped without
    # close is collected, and its OffPath's finalizer ends this thread)
    while True:
        item = work.get()
        if item is None:
            return
        fn, args = item
        del item
        try:
            with lock:
                fn(*args)
        except Exception:   # (the caller's next call does the same work inline, and says why if it fails)
            log.exception("work off the caller's path failed: %s", getattr(fn, "__qualname__", fn))
        del fn, args


def _holds(lock: Any) -> bool:
    """Whether this thread holds ``lock`` (an RLock's owner can tell; a Lock cannot: taken as held)."""
    owned = getattr(lock, "_is_owned", None)
    return owned() if owned is not None else True
