"""A process takes part in the broker's barriers once registered (``shm.fence``); a forked child
is a process of its own and registers again rather than inherit its parent's word for it."""

import os

import pytest

from ipcpool.shm import fence


def test_a_forked_child_registers_for_itself():
    if not fence.registered(wait=5.0):
        pytest.skip("this kernel has no membarrier registration")
    assert fence.registered() is True   # (the parent's answer, without asking the kernel again)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:   # the child: not registered until it asks, then registered in its own right
        try:
            before = fence.here
            os.write(w, b"%d %d" % (before, fence.registered(wait=5.0)))
        finally:
            os._exit(0)
    os.close(w)
    got = os.read(r, 64).split()
    os.close(r)
    os.waitpid(pid, 0)
    assert got == [b"0", b"1"]
