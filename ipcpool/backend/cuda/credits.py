"""The broker's credits a client keeps open, as a table a reader's take in C reads (``_native.c``'s
``seal_done``): the hand-off's hot path then finds a seal's CUevent by the entry's handle bytes in
one row, where a dict would need the bytes made into an object, hashed and looked up, and the
event's attribute read (~2 µs on a cold CPU, H100 host).

Layout (this process's memory, not shared): ``ROWS`` rows of ``ROW`` bytes, a credit's 64-byte
IPC event handle then its CUevent (u64, little-endian), at row ``row_of(handle)``; a row of zeros
is empty. One credit a row: a credit whose row another holds is not in the table
(its reader takes the general way, which asks the pool's dict), never a wrong row read as its own,
as the whole handle is compared. A row is cleared before its event is closed."""

from __future__ import annotations

HANDLE = 64
ROW = HANDLE + 8
ROWS = 1024   # (a pool keeps at most ``client_pool.MAX_OPEN_CREDITS`` open: few collide)
_MIX, _U64 = 0x9E3779B97F4A7C15, (1 << 64) - 1


def row_of(handle: bytes) -> int:
    """The row of a 64-byte handle: its eight words mixed by multiplication (the C's own, which
    fetches no table on a cold CPU as a crc32 would), the high half of the result."""
    h = 0
    for k in range(0, HANDLE, 8):
        h = ((h ^ int.from_bytes(handle[k : k + 8], "little")) * _MIX) & _U64
    return (h >> 32) % ROWS


class CreditTable:
    __slots__ = ("rows",)

    def __init__(self) -> None:
        self.rows = bytearray(ROWS * ROW)   # (never resized: the C reads it in place)

    @staticmethod
    def _at(handle: bytes) -> int | None:
        """Where the row of ``handle`` starts; None for bytes that are no handle."""
        return row_of(handle) * ROW if len(handle) == HANDLE else None

    def put(self, handle: bytes, event: int) -> None:
        """Credit ``handle`` open here as CUevent ``event``, where its row is free."""
        at = self._at(handle)
        if at is not None and event and not any(self.rows[at : at + ROW]):
            self.rows[at : at + ROW] = handle + event.to_bytes(8, "little")

    def drop(self, handle: bytes) -> None:
        """Credit ``handle`` about to close: out of its row, where it holds one."""
        at = self._at(handle)
        if at is not None and self.rows[at : at + HANDLE] == handle:
            self.rows[at : at + ROW] = bytes(ROW)

    def event(self, handle: bytes) -> int:
        """The CUevent of ``handle`` as the C reads it; 0 where its row holds another or none."""
        at = self._at(handle)
        if at is None or self.rows[at : at + HANDLE] != handle:
            return 0
        return int.from_bytes(self.rows[at + HANDLE : at + ROW], "little")

    def clear(self) -> None:
        self.rows[:] = bytes(len(self.rows))
