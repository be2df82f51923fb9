"""Which UCX transport moved the bytes, as UCX itself reports it.

With ``UCX_PROTO_INFO=y`` UCX writes the protocol it picks for each kind of operation (a table
whose rows name the transport and device: ``cma/memory``, ``tcp/eth0``, ``rc_mlx5/mlx5_0:1``,
``cuda_ipc/cuda``) into its log. While a puller's agent is made (``capturing``) the environment
asks for those tables and sends UCX's log to a file of ours (UCX fixes its log file when it is
first loaded); after a pull we read the table of the remote reads: no guess from the
configuration, the choice UCX made. Where the user set UCX's log file or turned the tables off,
the transport is reported as unknown.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

_log_path: str | None = None
_decided = False

# "into host memory from host", and for GPU memory "into cuda/GPU0 from cuda/dev[1]" (UCX 1.19):
# the kind of memory is the word before any "/".
_READ = re.compile(r"remote memory read by \S+ into (\w+)\S*(?: memory)? from (\w+)\S*(?: memory)?\s*\|")
_ROW = re.compile(r"\|\s*(\d+\.\.\S+|\d+)\s*\|([^|]*)\|([^|]*)\|")
_TRANSPORT = re.compile(r"\b([a-z][a-z0-9_]*)/[\w:.\-]+")


@dataclass(frozen=True)
class Transport:
    names: tuple[str, ...]     # UCX transports of the reads (tcp, cma, rc_mlx5, cuda_ipc, ...)
    into: str                  # the memory read into: host or cuda
    source: str                # the memory read from
    detail: str                # UCX's rows, as it wrote them

    @property
    def tcp_gpu(self) -> bool:
        """GPU memory that went over TCP: hundreds of times slower than the GPU could move it."""
        return "tcp" in self.names and "cuda" in (self.into, self.source)

    def describe(self) -> str:
        if not self.names:
            return "unknown"
        return f"{'+'.join(self.names)} ({self.source} memory to {self.into} memory)"


UNKNOWN = Transport((), "", "", "")


@contextmanager
def capturing() -> Iterator[None]:
    """Make a NIXL agent inside this: its UCX context writes its tables to our file. The
    environment is put back afterwards (child processes do not inherit it)."""
    global _log_path, _decided
    if not _decided:
        _decided = True
        if "UCX_LOG_FILE" not in os.environ and os.environ.get("UCX_PROTO_INFO", "y").lower() in ("y", "yes", "1"):
            where = tempfile.mkdtemp(prefix="ipcpool-ucx-")
            atexit.register(shutil.rmtree, where, True)
            _log_path = os.path.join(where, "ucx.log")
    if _log_path is None:   # the user's own UCX logging wins; the transport is then unknown
        yield
        return
    saved = {k: os.environ.get(k) for k in ("UCX_PROTO_INFO", "UCX_LOG_FILE")}
    os.environ.update(UCX_PROTO_INFO="y", UCX_LOG_FILE=_log_path)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def mark() -> int:
    """Where the log ends now: ``since(mark())`` reads what UCX chose after this point."""
    try:
        return os.path.getsize(_log_path) if _log_path else 0
    except OSError:
        return 0


def since(offset: int) -> Transport:
    if not _log_path:
        return UNKNOWN
    _flush()
    try:
        with open(_log_path, errors="replace") as f:
            f.seek(offset)
            return parse(f.read())
    except OSError:
        return UNKNOWN


def _flush() -> None:
    """UCX writes its log through stdio, buffered: flush every stream of the process (fflush(NULL))."""
    import ctypes

    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass


def log_path() -> str | None:
    return _log_path


def parse(text: str) -> Transport:
    """The transports of the remote-read tables in ``text`` (UCX_PROTO_INFO output)."""
    names: list[str] = []
    rows: list[str] = []
    into = source = ""
    reading = False
    for line in text.splitlines():
        head = _READ.search(line)
        if head:
            reading, into, source = True, head.group(1), head.group(2)
            continue
        if not reading or "|" not in line:
            continue
        row = _ROW.search(line)
        if row:
            rows.append(f"{row.group(1)} {row.group(2).strip()} {row.group(3).strip()}")
            for t in _TRANSPORT.findall(row.group(3)):
                if t not in names:
                    names.append(t)
        elif line.rstrip().endswith("|") and "Range" not in line and "+--" not in line:
            reading = False   # the next table's title
    return Transport(tuple(names), into, source, "; ".join(rows)) if names else UNKNOWN
