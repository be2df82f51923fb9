"""The credits a client keeps open, as the table a reader's take in C reads (``backend.cuda.credits``):
a credit is found by its whole handle in its one row, a credit whose row another holds is not in
the table (never read as the other), and a row is empty once dropped or cleared."""

import random

import pytest

from ipcpool.backend.cuda import credits as table

native = pytest.importorskip("ipcpool.shm._native", reason="not built here (no C compiler when installed)")


def _handles(n: int, seed: int = 7) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(table.HANDLE) for _ in range(n)]


def _two_in_one_row() -> tuple[bytes, bytes]:
    rows: dict[int, bytes] = {}
    for h in _handles(10_000):
        row = table.row_of(h)
        if row in rows:
            return rows[row], h
        rows[row] = h
    raise AssertionError("no two handles share a row")


def test_the_c_reads_the_layout_the_python_writes():
    assert native.CREDIT_ROW == table.ROW
    assert [table.row_of(h) for h in _handles(4, seed=1)] == [native.credit_row(h, table.ROWS) for h in _handles(4, seed=1)]


def test_a_credit_put_is_found_by_its_handle_and_gone_once_dropped():
    t = table.CreditTable()
    a, b = _handles(2)
    t.put(a, 0xDEADBEEF)
    assert t.event(a) == 0xDEADBEEF and t.event(b) == 0
    at = table.row_of(a) * table.ROW
    assert bytes(t.rows[at : at + table.ROW]) == a + (0xDEADBEEF).to_bytes(8, "little")
    t.drop(b)   # another's drop leaves it
    assert t.event(a) == 0xDEADBEEF
    t.drop(a)
    assert t.event(a) == 0 and not any(t.rows)


def test_a_credit_whose_row_another_holds_is_left_out_and_read_as_none():
    t = table.CreditTable()
    first, second = _two_in_one_row()
    t.put(first, 1)
    t.put(second, 2)   # its row is taken: not in the table (its reader asks the pool's dict)
    assert t.event(first) == 1 and t.event(second) == 0
    t.drop(second)     # ... and dropping it leaves the first where it is
    assert t.event(first) == 1
    t.drop(first)
    t.put(second, 2)   # the row free again: the second takes it
    assert t.event(second) == 2


@pytest.mark.parametrize("handle, event", [(b"short", 5), (bytes(range(64)), 0)])
def test_a_handle_not_64_bytes_or_no_event_puts_nothing(handle, event):
    t = table.CreditTable()
    t.put(handle, event)
    assert not any(t.rows) and t.event(handle) == 0


def test_clear_empties_every_row_and_keeps_the_tables_size():
    t = table.CreditTable()
    size = len(t.rows)
    for k, h in enumerate(_handles(50), 1):
        t.put(h, k)
    t.clear()
    assert len(t.rows) == size and not any(t.rows)
