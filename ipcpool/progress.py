"""A one-line progress bar on stderr (or any stream): long work shows how far it got."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, label: str, total: int, *, unit: str = "", stream: TextIO | None = None, width: int = 30):
        self.label, self.total, self.unit, self.width = label, max(total, 1), unit, width
        self.stream = stream or sys.stderr
        self.done = 0
        self._t0 = time.monotonic()
        self._last = 0.0

    def _fmt(self, n: float) -> str:
        if self.unit != "B":
            return f"{n:.0f}"
        for u in ("B", "KiB", "MiB", "GiB", "TiB"):
            if n < 1024 or u == "TiB":
                return f"{n:.1f} {u}" if u != "B" else f"{n:.0f} B"
            n /= 1024
        return str(n)

    def update(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        if now - self._last >= 0.1 or self.done >= self.total:
            self._last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        filled = self.width * min(self.done, self.total) // self.total
        rate = self.done / max(now - self._t0, 1e-9)
        self.stream.write(
            f"\r{self.label:<24} [{'#' * filled}{'.' * (self.width - filled)}] "
            f"{self._fmt(self.done)}/{self._fmt(self.total)} ({self._fmt(rate)}/s)"
        )
        self.stream.flush()

    def close(self) -> None:
        self._draw(time.monotonic())
        self.stream.write("\n")
        self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
