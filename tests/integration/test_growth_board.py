"""The growth board: the broker stamps a growable's word at every grow, before it answers, so a
process whose mapping cannot see a grow by itself (CUDA's path, taken here on the host with
``follows = False``) syncs without a request while nothing grew, and with one once something did."""

import ctypes
import mmap
import os

import pytest

import ipcpool
from ipcpool.shm import growboard
from tests.support.procs import SPAWN
from tests.support.counting import count_requests

MiB = 1 << 20


def board_of(client):
    return client._growables.board()


def follower(client, name):
    """``client`` attached to ``name`` the way CUDA follows: never from its own mapping, never
    from a notice."""
    h = client.attach_growable(name)
    h._mapping.follows = False
    client._channel.on_grown = lambda note: None
    return h


def test_the_word_changes_at_every_grow_and_only_then(broker):
    with ipcpool.connect(broker.socket_dir) as c:
        g = c.create_growable("gb/w", MiB)
        board = board_of(c)
        assert board is not None and g._word >= 0 and board.read(g._word) == g._stamp
        seen = {g._stamp}
        for size in (2 * MiB, 3 * MiB, 8 * MiB):
            g.grow(size)
            assert board.read(g._word) == g._stamp and g._stamp not in seen
            seen.add(g._stamp)
        g.grow(4 * MiB)                                   # no more than the size: no grow, same stamp
        assert board.read(g._word) == g._stamp
        c._channel.call("grow", name="gb/w", nbytes=16 * MiB)   # the message channel's grow stamps too
        assert board.read(g._word) not in seen
        g.close()


def test_the_board_travels_once_per_session_with_the_first_growable_reply(broker):
    with ipcpool.connect(broker.socket_dir) as c:
        ch = c._channel
        reply, fds = ch.control_call({"op": "grow_create", "name": "gb/once1", "nbytes": MiB, "pool": "default"})
        assert reply["board"] is True and len(fds) == 2                # the board, then the memfd
        assert reply["word"] >= 0 and isinstance(reply["stamp"], int)
        view = growboard.BoardView.open(fds[0])                         # takes the FD
        assert view is not None and view.read(reply["word"]) == reply["stamp"]
        os.close(fds[1])
        reply, fds = ch.control_call({"op": "grow_attach", "name": "gb/once1"})
        assert "board" not in reply and len(fds) == 1
        os.close(fds[0])
        reply, fds = ch.control_call({"op": "grow", "name": "gb/once1", "nbytes": 2 * MiB, "first": 1})
        assert "board" not in reply and view.read(reply["word"]) == reply["stamp"]
        for fd in fds:
            os.close(fd)
        view.close()


def test_a_follower_asks_once_after_a_grow_and_never_while_nothing_grew(broker):
    with ipcpool.connect(broker.socket_dir) as c, ipcpool.connect(broker.socket_dir) as d:
        g = c.create_growable("gb/f", 2 * MiB)
        h = follower(d, "gb/f")
        sent = count_requests(d)
        for size in (4 * MiB, 16 * MiB, 64 * MiB):
            for _ in range(20):
                assert h.sync().grown is False
            assert sent == {}
            g.grow(size)
            g.view()[size - 1] = size // MiB
            r = h.sync()
            assert sent == {"control:grow_sync": 1}
            assert r.grown and h.size == size and h.view()[size - 1] == size // MiB
            sent.clear()
        # Its own grow leaves nothing to ask about either: the grow's reply carried the stamp.
        h.grow(128 * MiB)
        assert sent == {"control:grow": 1}
        sent.clear()
        assert h.sync().grown is False and sent == {}
        h.close()
        g.close()


def _grow_and_tell(sock, conn):
    """In another process: grow, write the new tail, then tell the follower (after the reply)."""
    with ipcpool.connect(sock) as c:
        g = c.create_growable("gb/x", 2 * MiB)
        conn.send("created")
        for size in (4 * MiB, 8 * MiB, 32 * MiB):
            conn.recv()
            g.grow(size)
            g.view()[size - 1] = size // MiB
            conn.send(size)
        conn.recv()
        g.close()


def test_a_follower_told_by_the_grower_in_another_process_sees_the_grow(broker):
    ours, theirs = SPAWN.Pipe()
    p = SPAWN.Process(target=_grow_and_tell, args=(str(broker.socket_dir), theirs))
    p.start()
    try:
        assert ours.poll(60) and ours.recv() == "created"
        with ipcpool.connect(broker.socket_dir) as d:
            h = follower(d, "gb/x")
            sent = count_requests(d)
            for _ in range(3):
                assert h.sync().grown is False
                ours.send("grow")
                assert ours.poll(60)
                size = ours.recv()
                r = h.sync()                              # told after the grower's reply: mapped
                assert r.grown and h.size == size and h.view()[size - 1] == size // MiB
            assert sent == {"control:grow_sync": 3}
            ours.send("done")
            h.close()
        p.join(30)
        assert p.exitcode == 0
    finally:
        if p.is_alive():
            p.kill()
            p.join()


def test_a_reused_word_never_shows_a_stale_reader_its_old_stamp(broker):
    with ipcpool.connect(broker.socket_dir) as c:
        g = c.create_growable("gb/old", MiB)
        g.grow(2 * MiB)
        word, stamp = g._word, g._stamp
        g.close()
        c.delete_growable("gb/old")                       # destroyed: its word is free again
        n = c.create_growable("gb/new", MiB)
        assert n._word == word                            # the same word, taken again
        assert board_of(c).read(word) == n._stamp != stamp
        n.close()


def test_the_board_is_read_only_in_a_client(broker):
    with ipcpool.connect(broker.socket_dir) as c:
        g = c.create_growable("gb/ro", MiB)
        with pytest.raises(TypeError):
            board_of(c)._words[g._word] = 0               # the client's mapping is PROT_READ
        assert board_of(c).read(g._word) == g._stamp
        with ipcpool.connect(broker.socket_dir) as other:   # as any client receives it
            reply, fds = other._channel.control_call({"op": "grow_attach", "name": "gb/ro"})
            other._channel.call("grow_detach", name="gb/ro")
        board, memfd = fds
        os.close(memfd)
        try:   # nor can a client map it writable, write it, or change its length
            with pytest.raises(PermissionError):
                mmap.mmap(board, os.fstat(board).st_size)
            with pytest.raises(PermissionError):
                os.pwrite(board, b"\0" * 8, 8 * reply["word"])
            with pytest.raises(PermissionError):
                os.ftruncate(board, 0)
            libc = ctypes.CDLL(None, use_errno=True)
            libc.mmap.restype = ctypes.c_void_p
            libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
            libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
            addr = libc.mmap(None, mmap.PAGESIZE, mmap.PROT_READ, mmap.MAP_SHARED, board, 0)
            assert addr not in (None, ctypes.c_void_p(-1).value)
            assert libc.mprotect(addr, mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_WRITE) == -1
        finally:
            os.close(board)
        assert board_of(c).read(g._word) == g._stamp
        g.close()


def test_a_buffer_without_a_word_falls_back_to_asking_at_every_sync(start_broker):
    b = start_broker(config_text="[growth]\nboard = 1\n")
    with ipcpool.connect(b.socket_dir) as c, ipcpool.connect(b.socket_dir) as d:
        g1 = c.create_growable("gb/on", MiB)
        g2 = c.create_growable("gb/off", MiB)
        assert g1._word == 0 and g2._word == -1           # one word: the board is full
        h1, h2 = follower(d, "gb/on"), follower(d, "gb/off")
        sent = count_requests(d)
        for _ in range(3):
            assert h1.sync().grown is False and h2.sync().grown is False
        assert sent == {"control:grow_sync": 3}           # only the buffer without a word asks
        g2.grow(4 * MiB)
        assert h2.sync().size == 4 * MiB
        h1.close(), h2.close(), g1.close(), g2.close()
        c.delete_growable("gb/on")                        # its word goes to the next buffer made
        assert c.create_growable("gb/next", MiB)._word == 0


def test_no_board_at_all_every_sync_asks(start_broker):
    b = start_broker(config_text="[growth]\nboard = 0\n")
    with ipcpool.connect(b.socket_dir) as c, ipcpool.connect(b.socket_dir) as d:
        g = c.create_growable("gb/none", MiB)
        assert board_of(c) is None and g._word == -1
        h = follower(d, "gb/none")
        sent = count_requests(d)
        h.sync(), h.sync()
        assert sent == {"control:grow_sync": 2}
        g.grow(2 * MiB)
        assert h.sync().size == 2 * MiB
        h.close()
        g.close()
