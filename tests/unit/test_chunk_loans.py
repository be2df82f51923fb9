"""The client's side of chunks lent ahead of grows (ipcpool._client.loans): which loaned chunks a
grow names, and that every FD and handle goes where no buffer took it. The backend is a stand-in
that "imports" an FD as a handle naming it (the bookkeeping, not the GPU, is under test); the FDs
are real."""

from __future__ import annotations

import os

import pytest

from ipcpool._client.loans import ChunkLoans

MiB = 1 << 20


class Backend:
    maps_loans = True

    def __init__(self, fail=()):
        self.fail, self.imported, self.released = set(fail), [], []

    def import_loaned(self, device, fd):
        if fd in self.fail:
            raise RuntimeError("cuMemImportFromShareableHandle failed")
        self.imported.append(fd)
        return ("handle", fd)

    def release_loaned(self, device, handle):
        self.released.append(handle)


def is_open(fd) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def lend(loans, sizes, pool="default"):
    fds = [os.memfd_create("chunk") for _ in sizes]
    loans.add(pool, 0, [[i + 1, s] for i, s in enumerate(sizes)], fds)
    return fds


def test_a_grow_names_loaned_chunks_only_where_they_add_up_to_its_step():
    b = Backend()
    loans = ChunkLoans(b)
    fds = lend(loans, [4 * MiB, 8 * MiB, 16 * MiB])
    assert [c.lid for c in loans.plan("default", 12 * MiB)] == [2, 1]   # largest first
    assert loans.plan("default", 2 * MiB) == []                     # nothing that small
    assert loans.plan("default", 6 * MiB) == []                     # 4 fits, the rest does not
    assert loans.plan("other", 4 * MiB) == []                       # a loan is per pool
    assert b.imported == []                                          # nothing imported ahead
    chunks = loans.plan("default", 16 * MiB)
    assert loans.import_handles(chunks) == [(("handle", fds[2]), 16 * MiB)]
    loans.taken("default", chunks)
    assert not is_open(fds[2]) and loans.plan("default", 16 * MiB) == []
    loans.end("default")
    assert not any(is_open(fd) for fd in fds) and b.released == []   # never imported: FDs only


def test_a_chunk_the_driver_refuses_leaves_nothing_imported_and_the_fds_with_the_loan():
    fds = [os.memfd_create("chunk") for _ in range(2)]
    b = Backend(fail={fds[1]})
    loans = ChunkLoans(b)
    loans.add("default", 0, [[1, 8 * MiB], [2, 4 * MiB]], fds)
    plan = loans.plan("default", 12 * MiB)
    assert loans.import_handles(plan) is None
    assert b.released == [("handle", fds[0])] and all(is_open(fd) for fd in fds)
    loans.end_all()
    assert not any(is_open(fd) for fd in fds)


@pytest.mark.parametrize("maps", [True, False])
def test_a_malformed_row_or_a_backend_without_loans_closes_the_fd(maps):
    b = Backend()
    b.maps_loans = maps
    loans = ChunkLoans(b)
    fds = [os.memfd_create("chunk") for _ in range(3)]
    loans.add("default", 0, [[1, 4 * MiB], ["x", 4 * MiB]], fds)    # one row bad, one missing
    assert [is_open(fd) for fd in fds] == [maps, False, False]
    assert [c.lid for c in loans.plan("default", 4 * MiB)] == ([1] if maps else [])
    loans.end_all()
    assert not is_open(fds[0])
