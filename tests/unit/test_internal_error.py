"""A broker bug (an exception no check foresaw, inside a handler) reaches the client as an
``InternalError`` with its own wire code, never as a refusal of the request; the broker serves on."""

from __future__ import annotations

import logging
import threading

import pytest

import ipcpool
from ipcpool.backend import Choice
from ipcpool.broker import server
from ipcpool.config import Config
from ipcpool.errors import InternalError, InvalidRequest


@pytest.fixture
def in_process_broker(tmp_path):
    """A host broker polled by a thread of this process, so a test can break one of its handlers."""
    b = server.Broker(Config(), Choice("host", "chosen by the test"), tmp_path / "sock")
    b.start()
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            b.poll_once(20)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        yield b
    finally:
        stop.set()
        t.join(10)
        b.close()


def test_a_handler_bug_is_an_internal_error(in_process_broker, caplog):
    def broken(session, fields, rid):
        raise KeyError("a bug")

    in_process_broker.handlers.op_stats = broken
    caplog.set_level(logging.ERROR, logger="ipcpool")
    with ipcpool.connect(in_process_broker.socket_dir, timeout=10, arena_bytes=0) as c:
        with pytest.raises(InternalError, match="internal broker error .*broker bug.*traceback") as err:
            c.stats()
        assert not isinstance(err.value, InvalidRequest)
        assert err.value.code not in (ipcpool.IpcPoolError.code, InvalidRequest.code)
        del in_process_broker.handlers.op_stats   # mended: the same session is served again
        assert c.stats()["backend"] == "host"
    assert any(r.exc_info for r in caplog.records)   # the traceback is in the broker's log


def test_a_backend_failure_is_the_backends_error_not_a_bug(in_process_broker, caplog):
    """What the backend recognises as its own failure (CUDA: a driver error) reaches the client as
    the error the backend maps it to, logged without a traceback; anything else stays a bug."""
    class DriverFault(Exception):
        pass

    def failing(session, fields, rid):
        raise DriverFault("CUDA_ERROR_OUT_OF_MEMORY")

    def buggy(session, fields, rid):
        raise KeyError("a bug")

    backend = in_process_broker.backend
    backend.foreign_error = lambda exc: ipcpool.OutOfMemory(f"CUDA: {exc}") if isinstance(exc, DriverFault) else None
    in_process_broker.handlers.op_stats = failing
    caplog.set_level(logging.INFO, logger="ipcpool")
    with ipcpool.connect(in_process_broker.socket_dir, timeout=10, arena_bytes=0) as c:
        with pytest.raises(ipcpool.OutOfMemory, match="CUDA: CUDA_ERROR_OUT_OF_MEMORY"):
            c.stats()
        in_process_broker.handlers.op_stats = buggy
        with pytest.raises(InternalError):
            c.stats()
        # The control socket (growables, FDs) maps failures the same way.
        in_process_broker.handlers.op_grow_create = failing
        with pytest.raises(ipcpool.OutOfMemory, match="CUDA: CUDA_ERROR_OUT_OF_MEMORY"):
            c.create_growable("g", 2 << 20)
        in_process_broker.handlers.op_grow_create = buggy
        with pytest.raises(InternalError):
            c.create_growable("g", 2 << 20)
    failed = [r for r in caplog.records if "failed in the host backend" in r.getMessage()]
    assert len(failed) == 2 and all(r.exc_info is None for r in failed)
