"""Readers find named objects in their pool's name directory, with no request on the path, and
the lease they take there (a hazard slot in their lease page) keeps the memory from reuse."""

import mmap
import os
import signal
import socket
import struct
import threading
import time

import pytest

import ipcpool
from ipcpool import fdpass, frames, paths, protocol
from ipcpool.broker.directory import SPARE_PAGES
from ipcpool.fds import close_all
from ipcpool.shm import futex, leases, requests, sealboard
from tests.support.counting import count_requests
from tests.support.procs import SPAWN
from tests.support.waiting import wait_for

KiB = 1 << 10


def _warm(w, r, name="warm"):
    """One hand-off first: the reader imports the pool and the writer's arena once."""
    buf = w.create(name, 4 * KiB)
    buf.seal()
    w.flush()
    r.get(name, timeout=5).release()
    w.delete(name)


def _get_meanwhile(r, name):
    """``r.get(name)`` on a thread of its own, started: (the thread, where its lease will be)."""
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("lease", r.get(name, timeout=10)))
    t.start()
    return t, got


def test_a_reader_before_the_create_and_one_after_the_seal_send_no_request(broker, monkeypatch):
    monkeypatch.setenv("IPCPOOL_GET_SPIN_US", "10000000")   # spin on the directory, never park
    with ipcpool.connect(broker.socket_dir) as w, ipcpool.connect(broker.socket_dir) as r:
        _warm(w, r)
        sent = count_requests(r)
        early, got = _get_meanwhile(r, "h/early")
        time.sleep(0.05)                                  # the reader is spinning before the create
        buf = w.create("h/early", 4 * KiB)
        buf.view[:5] = b"first"
        buf.seal()
        early.join(10)
        late_buf = w.create("h/late", 4 * KiB)
        late_buf.view[:4] = b"late"
        late_buf.seal()
        w.flush()
        late = r.get("h/late", timeout=0)
        assert bytes(got["lease"].view[:5]) == b"first" and bytes(late.view[:4]) == b"late"
        assert got["lease"].dirlease is not None and late.dirlease is not None
        assert sum(v for k, v in sent.items() if k != "release") == 0, dict(sent)   # no request
        got["lease"].release()
        late.release()
        assert sent["release"] == 2                       # the releases go to the broker (R2)


def _directory_rss_kib() -> list[int]:
    """This process's resident KiB of each mapping of the default pool's name directory."""
    rss, inside = [], False
    with open("/proc/self/smaps") as f:
        for line in f:
            if "-" in line.split(" ", 1)[0]:   # a mapping's first line
                inside = "ipcpool-directory:default" in line
            elif inside and line.startswith("Rss:"):
                rss.append(int(line.split()[1]))
    return rss


def test_an_attach_leaves_the_directory_unmapped_and_a_reader_maps_its_pages_after_its_get(broker):
    """A worker taking its weights with ``get_many`` never reads the directory: it is not even
    mapped on that path (its FD is kept). A directory reader maps it at its first look and all its
    pages (4 MiB at the default size) after its first lease is released, off the get's path (the
    pages a later look touches fault no more)."""
    with ipcpool.connect(broker.socket_dir) as w:
        for name in ("w/a", "w/b"):
            buf = w.create(name, 4 * KiB)
            buf.view[:1] = b"w"
            buf.seal()
        w.flush()
        with ipcpool.connect(broker.socket_dir) as r:
            weights = r.get_many(["w/a"])
            assert bytes(weights[0].view[:1]) == b"w"
            assert len(_directory_rss_kib()) == 1 and not r._pools.directories   # (w's map alone)
            lease = r.get("w/b", timeout=5)
            assert lease.dirlease is not None and bytes(lease.view[:1]) == b"w"
            assert len(_directory_rss_kib()) == 2 and max(_directory_rss_kib()) < 1024   # (w's, r's: not paged in yet)
            lease.release()
            assert max(_directory_rss_kib()) >= r._pools.directories["default"][0].capacity * 512 // 1024


def _lease_page_inodes(pid: int) -> set[int]:
    """The inodes of the lease pages process ``pid`` holds open (its FDs)."""
    inodes, fd_dir = set(), f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            if "ipcpool-leases" in os.readlink(f"{fd_dir}/{fd}"):
                inodes.add(os.stat(f"{fd_dir}/{fd}").st_ino)
        except FileNotFoundError:   # (closed meanwhile)
            continue
    return inodes


def _mapped_lease_pages() -> set[int]:
    """The inodes of the lease pages this process maps."""
    with open("/proc/self/maps") as f:
        return {int(line.split()[4]) for line in f if "ipcpool-leases" in line}


def test_a_sessions_lease_page_is_made_before_it_connects_and_the_stock_made_up_after(broker):
    """The broker makes lease pages ahead while idle: a session's first pool import takes one, not
    one made on its reply's path (a restarted worker's attach waits for that reply)."""
    wait_for(lambda: len(_lease_page_inodes(broker.pid)) == SPARE_PAGES)
    ahead = _lease_page_inodes(broker.pid)
    with ipcpool.connect(broker.socket_dir) as w:
        buf = w.create("p/1", 4 * KiB)   # (imports the pool; the create maps the page to write its ring)
        buf.seal()
        w.flush()
        mine = _mapped_lease_pages()
        assert len(mine) == 1 and mine <= ahead, (mine, ahead)
        wait_for(lambda: len(_lease_page_inodes(broker.pid)) == SPARE_PAGES + 1)   # (its page, and two spare again)
    wait_for(lambda: len(_lease_page_inodes(broker.pid)) == SPARE_PAGES)   # (its page gone with the session)


def _count_wakes(client) -> list:
    """The ``wake`` of each get ``client`` sends from now on (None: a get that takes a lease)."""
    ch, wakes = client._channel, []
    send = ch.send

    def counted(op, **fields):
        if op == "get":
            wakes.append(fields.get("wake"))
        return send(op, **fields)

    ch.send = counted
    return wakes


def test_a_reader_past_its_spin_sleeps_until_woken_and_still_reads_from_the_directory(broker, monkeypatch):
    """Its spin (1 ms) runs out before the create: it sleeps until the broker answers a get that
    takes no lease. Then again before the seal: it sleeps on the object's board word, and the
    writer's post wakes it (no request; a sleep of 10 s unless woken). It reads from the directory."""
    monkeypatch.setenv("IPCPOOL_GET_SPIN_US", "1000")
    monkeypatch.setattr(futex, "SLICE_S", 10.0)
    with ipcpool.connect(broker.socket_dir) as w, ipcpool.connect(broker.socket_dir) as r:
        _warm(w, r)
        wakes = _count_wakes(r)
        reader, got = _get_meanwhile(r, "h/slow")
        wait_for(lambda: wakes == ["entry"])
        time.sleep(0.05)                                  # asleep before the create
        buf = w.create("h/slow", 4 * KiB)
        buf.view[:4] = b"slow"
        w.flush()
        board = w._pools.boards["default"]
        wait_for(lambda: board.sleeping)                  # asleep on the board word before the seal
        time.sleep(0.05)
        assert reader.is_alive()
        buf.seal()
        t0 = time.monotonic()
        reader.join(10)
        assert time.monotonic() - t0 < 5                  # woken by the post, not at the end of its sleep
        lease = got["lease"]
        assert bytes(lease.view[:4]) == b"slow" and lease.dirlease is not None
        assert wakes == ["entry"]
        assert w.list()[0]["leases"] == 1                 # the directory's lease, none of the broker's
        lease.release()


def test_a_reader_of_two_pools_past_its_spin_sleeps_on_its_socket_and_reads_from_the_directory(
        start_broker, monkeypatch):
    """With two directories to look in it cannot sleep on one (``shm.futex``): the broker's answer
    wakes it; once it has the entry, it sleeps on the object's board word for the seal."""
    monkeypatch.setenv("IPCPOOL_GET_SPIN_US", "1000")
    b = start_broker(config_text='[[pools]]\nname = "default"\n[[pools]]\nname = "second"\n')
    with ipcpool.connect(b.socket_dir) as w, ipcpool.connect(b.socket_dir) as r:
        _warm(w, r)
        buf = w.create("warm2", 4 * KiB, pool="second")
        buf.seal()
        w.flush()
        r.get("warm2", timeout=5).release()   # (the broker's lease: "second" imported, its directory mapped at the next look)
        assert list(r._pools.directories) == ["default"] and list(r._pools.unmapped) == ["second"]
        wakes = _count_wakes(r)
        reader, got = _get_meanwhile(r, "h/second")
        wait_for(lambda: wakes == ["entry"])
        time.sleep(0.05)
        buf = w.create("h/second", 4 * KiB, pool="second")
        buf.view[:3] = b"two"
        w.flush()
        wait_for(lambda: w._pools.boards["second"].sleeping)
        time.sleep(0.05)
        buf.seal()
        reader.join(10)
        lease = got["lease"]
        assert bytes(lease.view[:3]) == b"two" and lease.dirlease is not None and wakes == ["entry"]
        lease.release()


def test_a_wake_answered_after_the_entry_was_found_is_dropped(broker, monkeypatch):
    """The entry comes during the spin that follows the wake request: the answer, when it comes,
    is taken in and dropped (nothing kept for it)."""
    monkeypatch.setenv("IPCPOOL_GET_SPIN_US", "1000000")   # 1 s, then 1 s more once the broker is asked
    with ipcpool.connect(broker.socket_dir) as w, ipcpool.connect(broker.socket_dir) as r:
        _warm(w, r)
        wakes = _count_wakes(r)
        reader, got = _get_meanwhile(r, "h/found")
        wait_for(lambda: wakes == ["entry"])                # in the second spin (1 s) from here
        buf = w.create("h/found", 4 * KiB)
        buf.seal()
        w.flush()
        reader.join(10)
        assert got["lease"].dirlease is not None and wakes == ["entry"]
        got["lease"].release()
        r.stats()                                         # (a request: what arrived before its answer is taken in)
        assert r._handoff._wakes == {}


def test_the_brokers_wake_answers_take_no_lease_and_keep_the_gets_errors(broker):
    """A get with ``wake``, as the broker sees it: answered with nothing once the object exists
    ("entry") or is sealed or gone ("seal"); parked until then, within the get's timeout."""
    with ipcpool.connect(broker.socket_dir) as w, ipcpool.connect(broker.socket_dir) as r:
        ch = r._channel

        def answered(rid):
            return ch.wait_reply(rid, 10) == {"id": rid, "ok": True}

        assert answered(ch.send("get", name="none/x", wake="seal"))        # gone: its directory says so
        with pytest.raises(ipcpool.WaitTimeout, match="'none/x' was not sealed within the timeout"):
            ch.wait_reply(ch.send("get", name="none/x", wake="entry", timeout_ms=100), 10)
        with pytest.raises(ipcpool.InvalidRequest, match="wake: 'entry' or 'seal', got 'lease'"):
            ch.wait_reply(ch.send("get", name="none/x", wake="lease"), 10)
        parked = ch.send("get", name="w/1", wake="entry", timeout_ms=10_000)
        assert not ch._dealer.poll(200)                                     # parked: no answer yet
        buf = w.create("w/1", 4 * KiB)
        w.flush()
        assert answered(parked)                                             # at its create
        parked = ch.send("get", name="w/1", wake="seal", timeout_ms=10_000)
        assert not ch._dealer.poll(200)
        buf.seal()
        w.flush()
        assert answered(parked)                                             # at its seal
        assert answered(ch.send("get", name="w/1", wake="entry")) and answered(ch.send("get", name="w/1", wake="seal"))
        assert w.list()[0]["leases"] == 0                                   # none taken


def test_a_sleeping_directory_reader_times_out_with_the_gets_error(broker, monkeypatch):
    monkeypatch.setenv("IPCPOOL_GET_SPIN_US", "1000")
    with ipcpool.connect(broker.socket_dir) as w, ipcpool.connect(broker.socket_dir) as r:
        _warm(w, r)
        wakes = _count_wakes(r)
        t0 = time.monotonic()
        with pytest.raises(ipcpool.WaitTimeout, match="'never' was not sealed within the timeout"):
            r.get("never", timeout=0.3)
        assert 0.25 < time.monotonic() - t0 < 5 and wakes == ["entry"]
        w.create("never", 4 * KiB)                        # created, never sealed: asleep on its board word
        w.flush()
        t0 = time.monotonic()
        with pytest.raises(ipcpool.WaitTimeout, match="'never' was not sealed within the timeout"):
            r.get("never", timeout=0.3)
        assert 0.25 < time.monotonic() - t0 < 5 and wakes == ["entry"]


@pytest.mark.parametrize("what", ["entry", "seal"])
def test_a_directory_reader_asleep_when_its_broker_dies_is_told_so(start_broker, monkeypatch, what):
    """Asleep on its directory (past its spin, its wake request sent), it still watches its socket."""
    monkeypatch.setenv("IPCPOOL_GET_SPIN_US", "1000")
    b = start_broker()
    with ipcpool.connect(b.socket_dir) as w, ipcpool.connect(b.socket_dir) as r:
        _warm(w, r)
        if what == "seal":
            w.create("asleep", 4 * KiB)                   # created, never sealed
            w.flush()
        failed = {}

        def read():
            try:
                r.get("asleep")                           # no timeout: only the broker's end ends it
            except ipcpool.IpcPoolError as exc:
                failed["err"] = exc
        t = threading.Thread(target=read)
        t.start()
        time.sleep(0.3)
        b.kill()
        t0 = time.monotonic()
        t.join(20)
        assert not t.is_alive() and time.monotonic() - t0 < 5
        assert isinstance(failed.get("err"), ipcpool.BrokerGone), failed


def test_an_object_deleted_while_a_directory_reader_holds_it_is_not_reused(broker):
    with ipcpool.connect(broker.socket_dir) as w, ipcpool.connect(broker.socket_dir) as r:
        _warm(w, r)
        buf = w.create("kept", 64 * KiB)
        buf.view[:] = b"A" * (64 * KiB)
        buf.seal()
        w.flush()
        lease = r.get("kept", timeout=0)
        assert lease.dirlease is not None
        w.delete("kept")                                  # deleted while the reader holds it
        assert [o["name"] for o in w.list()] == []
        for i in range(200):                              # the writer re-carves as fast as it can
            other = w.create(f"churn/{i}", 64 * KiB)
            other.view[:] = b"B" * (64 * KiB)
            other.seal()
            if i % 20 == 19:
                w.flush()
                for j in range(i - 19, i + 1):
                    w.delete(f"churn/{j}")
            assert bytes(lease.view) == b"A" * (64 * KiB), f"reused under the reader at churn {i}"
        lease.release()
        w.flush()
        deadline = time.monotonic() + 5
        while w.stats()["pools"]["default"]["arena_free"] != w.stats()["pools"]["default"]["arena_bytes"]:
            assert time.monotonic() < deadline, "the released range never came back to its arena"
            time.sleep(0.01)


def _create_and_die(socket_dir, out):
    c = ipcpool.connect(socket_dir)
    c.create("doomed", 4 * KiB)
    c.flush()
    out.put(os.getpid())
    time.sleep(600)


@pytest.mark.parametrize("spin_us", ["10000000", "1000"], ids=["spinning", "asleep"])
def test_a_writer_killed_before_its_seal_gives_directory_readers_object_aborted(broker, monkeypatch, spin_us):
    """Asleep, the reader sleeps on the object's board word (10 s here): the broker wakes it at
    the abort."""
    monkeypatch.setenv("IPCPOOL_GET_SPIN_US", spin_us)
    monkeypatch.setattr(futex, "SLICE_S", 10.0)
    out = SPAWN.Queue()
    p = SPAWN.Process(target=_create_and_die, args=(broker.socket_dir, out))
    p.start()
    try:
        pid = out.get(timeout=60)
        with ipcpool.connect(broker.socket_dir) as r:
            failed = {}

            def read():
                try:
                    r.get("doomed", timeout=30)
                except ipcpool.IpcPoolError as exc:
                    failed["err"] = exc
            t = threading.Thread(target=read)
            t.start()
            time.sleep(0.3)                               # it found the entry and waits for the seal
            os.kill(pid, signal.SIGKILL)
            t0 = time.monotonic()
            t.join(20)
            assert time.monotonic() - t0 < 5
            assert isinstance(failed.get("err"), ipcpool.ObjectAborted)
            assert "abandoned before it was sealed" in str(failed["err"])
            assert r.list() == []
    finally:
        p.kill()
        p.join()


def test_garbage_in_a_lease_page_pins_at_most_its_own_slots(broker):
    with ipcpool.connect(broker.socket_dir) as w, ipcpool.connect(broker.socket_dir) as liar:
        _warm(w, liar)
        base = w.stats()["pools"]["default"]["used"]
        page = liar._pools.lease_page._map
        page[: requests.AT] = os.urandom(requests.AT)     # garbage in its slots first: nothing breaks
        names = [f"g/{i}" for i in range(150)]
        for n in names:
            w.create(n, 4 * KiB).seal()
        w.flush()
        view, pidx = liar._pools.directories["default"]
        entries = [view.lookup(n) for n in names]
        # Then slots that name real objects, as many as the page has: the most it can pin.
        struct.pack_into("<Q", page, 0, leases.SLOTS)
        for s, e in enumerate(entries[: leases.SLOTS]):
            struct.pack_into("<IIQQ", page, leases.HEAD + s * leases.SLOT, pidx, e.index, e.gen, 10**6 + s)
        for n in names:
            w.delete(n)
        w.flush()
        pool = w.stats()["pools"]["default"]
        assert w.stats()["sessions"] == 2 and pool["used"] == base   # arenas stay whole while their session lives
        assert w.list() == []
        pinned = pool["arena_bytes"] - pool["arena_free"]
        assert pinned == leases.SLOTS * 4 * KiB                      # its slots' objects, not one more
    deadline = time.monotonic() + 5
    with ipcpool.connect(broker.socket_dir) as c:                   # the liar is gone: nothing left
        while c.stats()["pools"]["default"]["used"] != 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert c.stats()["sessions"] == 1


def test_a_client_cannot_write_the_directory_nor_reopen_it_writable(broker):
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.connect(str(broker.socket_dir / paths.CONTROL_NAME))
        fdpass.send(s, {"op": "hello", "version": protocol.PROTOCOL_VERSION})
        assert fdpass.recv(s)[0]["ok"]
        fdpass.send(s, {"op": "pool_fd", "pool": "default", "id": 1})
        reply, fds = fdpass.recv(s)
        directory = fds[2]
        try:
            size = os.fstat(directory).st_size
            with pytest.raises(PermissionError):
                mmap.mmap(directory, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            with pytest.raises(PermissionError):
                os.pwrite(directory, b"x", 0)
            again = os.open(f"/proc/self/fd/{directory}", os.O_RDWR)
            try:
                with pytest.raises(PermissionError):
                    os.pwrite(again, b"x", 0)
                with pytest.raises(PermissionError):
                    mmap.mmap(again, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(again)
            with pytest.raises(PermissionError):
                os.ftruncate(directory, 0)
        finally:
            close_all(fds)


def test_a_seal_on_the_board_is_the_brokers_before_its_message_arrives(broker):
    """One state per object: once the writer's seal is on the board (what a reader sees), the
    broker's answers agree before the seal's own message has come: list says sealed, get_many
    leases it, another session may delete it; the message, when it comes, is no error."""
    with ipcpool.connect(broker.socket_dir) as w, ipcpool.connect(broker.socket_dir) as r:
        held = []
        for name in ("one", "two"):
            buf = w.create(name, 4 * KiB)
            buf.view[:3] = b"abc"
            w.flush()
            cut = buf.carving                            # the seal's board post alone, its message held back
            w._handoff.boards["default"].post(cut.arena.words + cut.slot, cut.seq)
            held.append(buf)
        assert {o["state"] for o in r.list()} == {"sealed"}
        [lease] = r.get_many(["one"])
        assert bytes(lease.view[:3]) == b"abc"
        lease.release()
        r.delete("two")                                   # not "being written by another session"
        for buf in held:                                  # the seal messages, late: no error
            buf.seal()
        w.flush()
        assert [o["name"] for o in r.list()] == ["one"]


def test_a_later_number_on_an_objects_board_word_is_not_its_seal(broker):
    """A board word serves the next object once the last one was sealed or given up (the writer does
    not wait for the broker to have the abort): a later object's number there must not read as this
    object's seal, neither to the broker nor to a directory reader, or a given-up object's memory
    would be taken for sealed. Only its own number seals it."""
    with ipcpool.connect(broker.socket_dir) as w, ipcpool.connect(broker.socket_dir) as r:
        _warm(w, r)
        buf = w.create("x", 4 * KiB)
        buf.view[:3] = b"abc"
        w.flush()
        cut, board = buf.carving, w._handoff.boards["default"]
        board.post(cut.arena.words + cut.slot, cut.seq + 1)   # the word's next object's seal
        assert [(o["name"], o["state"]) for o in r.list("x")] == [("x", "writing")]   # the broker's answer
        with pytest.raises(ipcpool.WaitTimeout):
            r.get("x", timeout=0.2)                           # a directory reader's
        buf.seal()                                            # its own number
        with r.get("x", timeout=5) as lease:
            assert bytes(lease.view[:3]) == b"abc"


def test_a_given_up_objects_board_word_serves_the_next_ones(broker):
    """An arena has BLOCK board words; a word kept from use for each object given up (as it was)
    left an arena that gave up that many with none, and its readers then waited on the broker."""
    with ipcpool.connect(broker.socket_dir) as w, ipcpool.connect(broker.socket_dir) as r:
        _warm(w, r)
        arenas = set()
        for i in range(sealboard.BLOCK + 8):
            buf = w.create(f"given-up/{i}", 4 * KiB)
            arenas.add(buf.carving.arena.aid)
            buf.free()
            w.flush()                                         # (its range back in the arena too)
        buf = w.create("after", 4 * KiB)
        assert arenas == {buf.carving.arena.aid}              # all from one arena (one block of words)
        assert buf.carving.slot is not None                   # it has a board word
        buf.view[:2] = b"ok"
        buf.seal()
        w.flush()
        assert w.async_errors == [] and [o["name"] for o in r.list()] == ["after"]
        sent = count_requests(r)
        with r.get("after", timeout=5) as lease:
            assert bytes(lease.view[:2]) == b"ok"
        assert sent["get"] == 0                               # from the directory, no request


def test_an_arena_in_a_block_used_before_numbers_its_objects_past_the_last_ones(broker):
    """A reader may still watch a board word for an object of a session that is gone (asleep, or
    descheduled): the next arena in that block numbers its objects on from past the last one's, so
    that number is never posted there again; the broker refuses a create numbered below."""
    with ipcpool.connect(broker.socket_dir) as a:
        for i in range(5):
            buf = a.create(f"a/{i}", 4 * KiB)
            words, last = buf.carving.arena.words, buf.carving.seq   # (the last number it gave out)
            buf.seal()
        a.flush()
    with ipcpool.connect(broker.socket_dir) as b:
        buf = b.create("b/0", 4 * KiB)
        arena = buf.carving.arena
        assert arena.words == words and buf.carving.seq > last   # the same block, numbered on
        buf.seal()
        offset = arena.carve(4 * KiB)
        b._channel.send_frame(frames.create, b"default", b"b/low", b"", arena.aid, offset, 4 * KiB, 9, 1, b"")
        b.list()   # (its answer came before this one's)
        with pytest.raises(ipcpool.InvalidRequest, match=f"seq 1 is outside {last + 1}\\.\\.[0-9]+, where arena"):
            b.flush()
        offset = arena.carve(4 * KiB)   # a number past any a count reaches: refused too
        b._channel.send_frame(frames.create, b"default", b"b/high", b"", arena.aid, offset, 4 * KiB, 9,
                              sealboard.FIRST_MAX, b"")
        b.list()
        with pytest.raises(ipcpool.InvalidRequest, match=f"seq {sealboard.FIRST_MAX} is outside"):
            b.flush()
        assert [o["name"] for o in b.list("b/")] == ["b/0"]


def test_a_reader_that_asks_nothing_else_never_runs_out_of_lease_slots(broker):
    """Its releases' answers free its slots; a reader that only reads from the directory would never
    read them, and every 120th get would go to the broker instead."""
    with ipcpool.connect(broker.socket_dir) as w, ipcpool.connect(broker.socket_dir) as r:
        _warm(w, r)
        sent = count_requests(r)
        n = 3 * leases.SLOTS
        for i in range(n):
            buf = w.create(f"s/{i}", 4 * KiB)
            buf.view[:4] = i.to_bytes(4, "little")
            buf.seal()
        w.flush()
        for i in range(n):
            lease = r.get(f"s/{i}", timeout=0)
            assert lease.dirlease is not None and bytes(lease.view[:4]) == i.to_bytes(4, "little")
            lease.release()
        assert sent["get"] == 0 and sent["release"] == n, dict(sent)


def test_an_object_given_up_while_its_reader_imports_its_arena_is_aborted_for_that_reader(broker):
    """A reader finds an unsealed entry in an arena it has not imported yet, and asks the broker
    for it (``dir_export``); the writer gives the object up meanwhile. The reader's slot then finds
    the entry gone: it is told ObjectAborted at once, as a reader waiting for the seal is, and
    does not wait at the broker for a create of that name anew."""
    with ipcpool.connect(broker.socket_dir) as w, ipcpool.connect(broker.socket_dir) as r:
        r.stats()   # (the reader's pool, not the writer's arena)
        buf = w.create("dropped", 4 * KiB)
        handoff, real = r._handoff, r._handoff._arena_for

        def arena_for(pool, entry):   # the writer gives up while this reader imports the arena
            buf.free()
            w.flush()   # (the broker has the abort)
            return real(pool, entry)

        handoff._arena_for = arena_for
        asked = count_requests(r)
        began = time.monotonic()
        with pytest.raises(ipcpool.ObjectAborted, match="'dropped' was abandoned"):
            r.get("dropped", timeout=10)
        assert time.monotonic() - began < 5 and asked["get"] == 0
        assert w.list() == [] and r.list() == []
