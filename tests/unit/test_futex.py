"""Sleeping on a word of shared memory: a reader maps the word read-only, the writer's mapping wakes it."""

import mmap
import multiprocessing as mp
import time

import pytest

from ipcpool.shm import futex, sealing

FORK = mp.get_context("fork")   # (the child inherits the memfd as it is, no FD passing)

pytestmark = pytest.mark.skipif(not futex.usable, reason="no futex on this platform")


def _sleeper(fd, out):
    ro = mmap.mmap(fd, mmap.PAGESIZE, access=mmap.ACCESS_READ)
    words = memoryview(ro).cast("Q")
    seen = words[2]
    out.put("asleep")
    t0 = time.monotonic()
    futex.wait(futex.address(ro, 16), seen, 30.0)
    out.put((time.monotonic() - t0, words[2]))
    words.release()


def test_a_reader_asleep_on_a_read_only_word_is_woken_by_the_writers_mapping():
    fd, m = sealing.create("futex-test", mmap.PAGESIZE, sealing.READ_ONLY)
    out = FORK.Queue()
    p = FORK.Process(target=_sleeper, args=(fd, out))
    p.start()
    try:
        assert out.get(timeout=60) == "asleep"
        time.sleep(0.2)                                   # asleep in the kernel by now
        words = sealing.words(m)
        words[2] += 1
        woken = futex.wake(futex.address(m, 16))
        slept, value = out.get(timeout=20)
        assert value == 1 and slept < 10, (slept, value)   # woken, not timed out (30 s)
        assert woken in (0, 1)                             # (0: it had not gone to sleep yet, and saw the change)
        words.release()
    finally:
        p.join(20)
        m.close()


def test_a_sleep_ends_at_once_where_the_word_moved_and_after_its_timeout_else():
    fd, m = sealing.create("futex-test", mmap.PAGESIZE, sealing.READ_ONLY)
    try:
        words = sealing.words(m)
        words[2] = 7
        at = futex.address(m, 16)
        t0 = time.monotonic()
        assert futex.wait(at, 6, 5.0)                     # the word is not 6: no sleep
        assert time.monotonic() - t0 < 1
        t0 = time.monotonic()
        assert futex.wait(at, 7, 0.05)                    # still 7: the timeout ends it
        assert 0.04 < time.monotonic() - t0 < 2
        assert not futex.wait(8, 0, 0.05)                 # no memory there: the caller sleeps otherwise
        with pytest.raises(ValueError, match="4-byte aligned"):
            futex.address(m, 2)
        words.release()
    finally:
        m.close()
