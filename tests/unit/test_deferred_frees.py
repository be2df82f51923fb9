"""DeferredFrees.run_ready as pure logic (allocations and waits are stand-ins; the GPU suite frees
real ones): a free that fails is logged and dropped, and the frees queued behind it still run."""

import logging

import pytest

ordering = pytest.importorskip("ipcpool.backend.cuda.ordering", exc_type=ImportError)


class Alloc:
    def __init__(self, name, pending_waits=0):
        self.name = name
        self.waits = [Wait() for _ in range(pending_waits)]


class Wait:
    def settle(self):
        return False   # its done event has not completed


def test_a_failing_free_is_dropped_and_logged_and_the_others_still_run(caplog):
    freed = []

    def free_now(alloc):
        if alloc.name == "bad":
            raise RuntimeError("CUDA_ERROR_INVALID_HANDLE")
        freed.append(alloc.name)

    frees = ordering.DeferredFrees()
    for alloc, owner in ((Alloc("a"), "zero"), (Alloc("bad"), "one"), (Alloc("waiting", 1), "zero"), (Alloc("b"), "one")):
        frees.add(alloc, free_now, owner)
    with caplog.at_level(logging.ERROR):
        frees.run_ready()
    assert freed == ["a", "b"]
    assert len(frees) == 1 and frees.owners() == ["zero"]   # only the one still waiting
    assert "a free in pool 'one' failed and is dropped: CUDA_ERROR_INVALID_HANDLE" in caplog.text
    frees.run_ready()   # the failed one is not tried again
    assert freed == ["a", "b"] and len(frees) == 1
