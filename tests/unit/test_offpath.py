"""A client's work off its caller's path (``ipcpool._client.offpath``): one thread of its own, each
piece under the client's lock, in order; inline where there is no such thread (closed, or a forked
child); its failures logged, not lost; a thread that ends with its client."""

import gc
import logging
import os
import threading

from ipcpool._client.offpath import OffPath


def _names_of_threads_that_ran(work: OffPath, lock, count: int) -> list[tuple[str, int, bool]]:
    ran = []

    def piece(k):
        ran.append((threading.current_thread().name, k, lock._is_owned()))

    for k in range(count):
        work.ask(piece, k)
    assert work.wait()
    return ran


def test_work_runs_on_its_own_thread_in_order_under_the_lock():
    lock = threading.RLock()
    work = OffPath(lock, name="offpath-test")
    assert not work.running
    ran = _names_of_threads_that_ran(work, lock, 50)
    assert ran == [("offpath-test", k, True) for k in range(50)]
    assert work.running
    work.close()
    assert not work.running


def test_work_waits_for_the_lock_its_caller_holds():
    lock = threading.RLock()
    work = OffPath(lock)
    ran = threading.Event()
    with lock:   # (a client call under way: the piece runs once it returns)
        work.ask(ran.set)
        assert not ran.wait(0.2)
    assert ran.wait(5)
    work.close()


def test_a_failing_piece_is_logged_and_the_next_runs(caplog):
    lock = threading.RLock()
    work = OffPath(lock)
    after = []

    def fails():
        raise RuntimeError("no carve today")

    with caplog.at_level(logging.ERROR, logger="ipcpool._client.offpath"):
        work.ask(fails)
        work.ask(after.append, "ran")
        assert work.wait()
    assert after == ["ran"]
    assert "work off the caller's path failed" in caplog.text and "no carve today" in caplog.text
    work.close()


def test_after_close_work_runs_inline_and_the_thread_has_ended():
    lock = threading.RLock()
    work = OffPath(lock, name="offpath-closing")
    _names_of_threads_that_ran(work, lock, 1)
    thread = work._thread
    work.close()
    assert not thread.is_alive()
    ran = _names_of_threads_that_ran(work, lock, 2)
    assert ran == [(threading.current_thread().name, 0, True), (threading.current_thread().name, 1, True)]


def test_close_while_holding_the_lock_does_not_wait_for_the_thread():
    lock = threading.RLock()
    work = OffPath(lock)
    _names_of_threads_that_ran(work, lock, 1)
    queued = []
    with lock:   # (a client's close holds its lock: the thread may wait for it, so close must not)
        work.ask(queued.append, "before close")
        work.close()
        assert work._thread.is_alive()
    work._thread.join(5)
    assert not work._thread.is_alive() and queued == ["before close"]   # what was asked still ran


def test_in_a_forked_child_work_runs_inline():
    lock = threading.RLock()
    work = OffPath(lock)
    _names_of_threads_that_ran(work, lock, 1)
    pid = os.fork()
    if pid == 0:   # the thread is not copied into the child: work there must not be queued for it
        try:
            ran = []
            work.ask(lambda: ran.append(threading.current_thread() is threading.main_thread()))
            os._exit(0 if ran == [True] and not work.running else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert work.running   # the parent's thread serves on
    work.close()


def test_a_dropped_offpath_ends_its_thread():
    lock = threading.RLock()
    work = OffPath(lock)
    _names_of_threads_that_ran(work, lock, 1)
    thread = work._thread
    del work
    gc.collect()
    thread.join(5)
    assert not thread.is_alive()
