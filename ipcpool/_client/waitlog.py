"""Saying once that a wait goes on. A ``get`` without a timeout on a name that never comes blocks
for ever; after LOG_AFTER_S one warning names what it waits for, so a stuck worker is found from
its log instead of a debugger."""

from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)

LOG_AFTER_S = 5.0   # a seal normally comes within milliseconds; seconds are worth a word


class SlowWait:
    """A wait without a deadline: ``tick()`` in its loop logs once, ``poll_ms()`` bounds its sleeps
    so that the log line is not late."""

    def __init__(self, what: str, after_s: float | None = None):
        self.what = what
        self.started = time.monotonic()
        self._at = self.started + (LOG_AFTER_S if after_s is None else after_s)
        self.logged = False

    def poll_ms(self, timeout_ms: int = -1) -> int:
        """``timeout_ms`` (-1: none) cut to when the line is due, while it is not logged yet."""
        if self.logged:
            return timeout_ms
        due = max(0, int((self._at - time.monotonic()) * 1000) + 1)
        return due if timeout_ms < 0 else min(timeout_ms, due)

    def tick(self) -> None:
        if self.logged or time.monotonic() < self._at:
            return
        self.logged = True
        log.warning("still waiting for %s after %.0f s (no timeout was given: it waits until it comes); "
                    "is its producer running? `ipcpool ls` shows what exists",
                    self.what, time.monotonic() - self.started)


def describe(op: str, fields: dict) -> str:
    """What a request without a deadline waits for, in a log line."""
    name = fields.get("name")
    return f"object {name!r} to be sealed ({op})" if op == "get" and name else f"the broker's answer to {op}"
