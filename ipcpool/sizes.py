"""Byte sizes: one parser (the config's "1G", the CLI's ``--keep 1G``), one formatter (every
table and message the CLI prints), rounding up to a granularity (chunks, pages, grow steps), and
the size of CUDA's handles, which the wire and the CUDA backend check alike."""

from __future__ import annotations

# CUDA pointer export data and IPC event handles (the driver's CU_IPC_HANDLE_SIZE). Here, not in
# the protocol, because the backend checks it too and never imports the protocol.
HANDLE_BYTES = 64

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_NAMES = ("B", "KiB", "MiB", "GiB", "TiB")


def round_up(n: int, granularity: int) -> int:
    """``n`` rounded up to a multiple of ``granularity``."""
    return -(-n // granularity) * granularity


def parse_size(value: int | str) -> int:
    """An int of bytes, or a string such as "4096", "512M", "1.5G", "8GiB" (binary units, any case).
    Raises ValueError, naming what it got, for anything else or a negative size."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a size must not be negative, got {value}")
        return value
    if isinstance(value, str):
        text = value.strip().lower().removesuffix("ib").removesuffix("b")
        unit = text[-1:] if text[-1:] in _UNITS else ""
        number = text[: len(text) - len(unit)].strip()
        try:
            size = float(number) * _UNITS[unit]
        except ValueError:
            pass
        else:
            if size >= 0 and size == size and size != float("inf"):
                return int(size)
    raise ValueError(f"expected a size such as 1073741824 or \"1G\", got {value!r}")


def format_size(n: float) -> str:
    """``1536`` -> "1.5 KiB"; whole bytes below 1 KiB ("512 B")."""
    for unit in _NAMES:
        if abs(n) < 1024 or unit == _NAMES[-1]:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
