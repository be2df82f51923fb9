"""A reader asleep on a seal-board word (``shm.sealboard``): the writer's post wakes it, in another
process, with no broker between; a reader that says nothing is asleep costs the writer nothing."""

import ctypes
import multiprocessing as mp
import os
import time

import pytest

from ipcpool.shm import futex, sealboard

FORK = mp.get_context("fork")   # (the child inherits the board's memfd)

pytestmark = pytest.mark.skipif(not futex.usable, reason="no futex on this platform")


def _sleeper(fd, out):
    board = sealboard.Board(os.dup(fd), owner=False)   # a client's mapping of the pool's board
    out.put("asleep")
    t0 = time.monotonic()
    board.sleep(300, 0, 30.0)
    out.put((time.monotonic() - t0, board.read(300)))
    board.close()


def test_a_reader_asleep_on_its_word_is_woken_by_the_writers_post():
    board = sealboard.Board.create("sleep-test")
    out = FORK.Queue()
    p = FORK.Process(target=_sleeper, args=(board.fd, out))
    p.start()
    try:
        assert out.get(timeout=60) == "asleep"
        time.sleep(0.2)                                   # in the kernel by now
        assert board.sleeping                             # it said so on the board
        board.post(300, 1)
        slept, value = out.get(timeout=20)
        assert value == 1 and slept < 10, (slept, value)   # woken by the post, not by its 30 s
    finally:
        p.join(20)
        board.close()


def test_a_sleep_ends_at_once_where_the_word_moved_and_the_board_says_who_may_sleep():
    board = sealboard.Board.create("sleep-test")
    try:
        assert board.sleeps and not board.sleeping        # nobody asleep: a post makes no system call
        board.post(7, 3)
        t0 = time.monotonic()
        assert board.sleep(7, 2, 0.5)                      # the word holds 3, not 2: no sleep
        assert time.monotonic() - t0 < 0.4 and board.sleeping   # (said before it looked)
        t0 = time.monotonic()
        assert board.sleep(7, 3, 0.05)                     # still 3: its timeout ends it
        assert 0.04 < time.monotonic() - t0 < 2
        assert not board.sleep(sealboard.WORDS, 0, 0.05)  # no such word: the caller sleeps some other way
        assert not board.sleep(-1, 0, 0.05)
        time.sleep(0.5 + sealboard._SLEEP_MARGIN_NS / 1e9)
        assert not board.sleeping                         # said only for as long as it may sleep
    finally:
        board.close()


def _driver_loaded() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD | os.RTLD_NOW)
    except OSError:
        return False
    return True


def test_a_post_after_a_record_needs_the_cuda_driver_and_a_word_of_the_board():
    """Without a CUDA driver loaded (the host) the seal's one call does nothing: the caller records
    and posts as usual; a word outside the board is an error, not a write."""
    native = pytest.importorskip("ipcpool.shm._native", reason="ipcpool's C part is not built here")
    board = sealboard.Board.create("t")
    try:
        if not _driver_loaded():
            assert board.post_after(1, 0, 5, 7) is None
            assert board._words[5] == 0
        with pytest.raises(IndexError, match="no such seal board word"):
            native.record_post(1, 0, board._map, sealboard.WORDS, 7)
        with pytest.raises(IndexError, match="no such seal board word"):
            native.record_post(1, 0, board._map, -1, 7)
        with pytest.raises(IndexError, match="no such seal board word"):
            native.record_post(1, 0, bytearray(64), 0, 7)
    finally:
        board.close()
