"""How far long work got (``ipcpool load``, the benchmarks): a rich progress bar on a terminal;
plain lines where the stream is not one (a log, a pipe, the journal), never ``\\r`` frames."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from .sizes import format_size


class Progress:
    """``with Progress("loading x", total, unit="B") as bar: bar.update(n)``.

    Off a terminal, one line at most every ``interval`` seconds while the work runs, and one at
    the end with the time taken and the rate."""

    def __init__(self, label: str, total: int, *, unit: str = "", stream: TextIO | None = None,
                 interval: float = 5.0):
        self.label, self.total, self.unit, self.interval = label, max(int(total), 1), unit, interval
        self.stream = stream or sys.stderr
        self.done = 0
        self._t0 = self._last = time.monotonic()
        self._closed = False
        self._bar: Any = None
        isatty = getattr(self.stream, "isatty", None)
        if isatty is not None and isatty():
            self._bar = self._rich_bar()

    def _rich_bar(self) -> Any:
        from rich.console import Console
        from rich.progress import (BarColumn, DownloadColumn, MofNCompleteColumn, TaskProgressColumn,
                                   TextColumn, TimeElapsedColumn, TimeRemainingColumn, TransferSpeedColumn)
        from rich.progress import Progress as RichProgress

        amount = ([DownloadColumn(binary_units=True), TransferSpeedColumn()] if self.unit == "B"
                  else [MofNCompleteColumn(), TaskProgressColumn()])
        bar = RichProgress(TextColumn("{task.description}", markup=False), BarColumn(), *amount,
                           TimeElapsedColumn(), TimeRemainingColumn(),
                           console=Console(file=self.stream, markup=False, highlight=False))
        bar.start()
        self._task = bar.add_task(self.label, total=self.total)
        return bar

    def _fmt(self, n: float) -> str:
        return format_size(n) if self.unit == "B" else f"{n:,.0f}"

    def update(self, n: int = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(self._task, advance=n)
            return
        now = time.monotonic()
        if now - self._last >= self.interval and self.done < self.total:
            self._last = now
            self._line(f"{self._fmt(self.done)} of {self._fmt(self.total)} ({100 * self.done // self.total}%)")

    def _line(self, text: str) -> None:
        self.stream.write(f"{self.label}: {text}\n")
        self.stream.flush()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.stop()
            return
        took = max(time.monotonic() - self._t0, 1e-9)
        rate = self.done / took
        self._line(f"{self._fmt(self.done)} of {self._fmt(self.total)} in {took:.1f} s "
                   f"({self._fmt(rate)}{'' if self.unit == 'B' else ' ' + (self.unit or 'steps')}/s)")

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
