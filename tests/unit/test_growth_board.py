"""The growth board's words and stamps (ipcpool.shm.growboard), without a broker."""

import fcntl
import mmap
import os

import pytest

from ipcpool.shm.growboard import BoardView, GrowthBoard


def test_stamps_never_repeat_and_a_full_board_gives_no_word():
    board = GrowthBoard(3)
    try:
        taken = [board.take() for _ in range(3)]
        assert [w for w, _ in taken] == [0, 1, 2] and board.take() == (-1, 0)
        stamps = {s for _, s in taken}
        for _ in range(5):
            stamps.add(board.stamp(1))
        assert len(stamps) == 8 and board.read(1) == max(stamps)
        old = board.read(1)
        board.give_back(1)
        word, stamp = board.take()                # the word freed last is taken next
        assert word == 1 and board.read(1) == stamp != old
        assert board.stamp(-1) == 0 and board.stamp(3) == 0   # no word: nothing stored
    finally:
        board.close()


def test_a_client_maps_the_sealed_board_read_only():
    board = GrowthBoard(16)
    try:
        word, stamp = board.take()
        view = BoardView.open(os.dup(board.fd))
        assert view is not None and view.read(word) == stamp
        with pytest.raises(TypeError):
            view._words[word] = 0
        assert board.stamp(word) == view.read(word)   # the broker's stores are seen at once
        assert view.read(-1) is None and view.read(mmap.PAGESIZE // 8) is None
        view.close()
        assert view.read(word) is None
    finally:
        board.close()


def test_an_unsealed_or_odd_file_is_no_board():
    fd = os.memfd_create("not-a-board", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, mmap.PAGESIZE)
    assert BoardView.open(os.dup(fd)) is None                 # writable by whoever holds it
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    assert BoardView.open(os.dup(fd)) is None                 # still writable
    os.close(fd)
    fd = os.memfd_create("empty", os.MFD_CLOEXEC)
    assert BoardView.open(fd) is None                          # no words (and the FD is closed)
    with pytest.raises(OSError):
        os.fstat(fd)
