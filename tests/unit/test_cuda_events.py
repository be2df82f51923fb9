"""Recording an IPC event, as pure logic: the stream and the driver call are stand-ins here (the
GPU suite records real ones, on one device and across two)."""

import contextlib

import pytest

events = pytest.importorskip("ipcpool.backend.cuda.events", exc_type=ImportError)

from ipcpool.errors import IpcPoolError  # noqa: E402


def cuda_failure(what):
    exc = IpcPoolError(f"{what} failed: CUDA_ERROR_INVALID_HANDLE")
    exc.cuda_result = 400   # as errors.check marks a failed driver call
    return exc


class Event:
    def __init__(self, steps):
        self.handle, self.steps = 7, steps

    def close(self):
        self.steps.append("close")


class Stream:
    """Refuses the record ``refusals`` times, as a stream of another context than the current."""

    def __init__(self, steps, refusals, error=None):
        self.steps, self.refusals, self.error = steps, refusals, error

    def record(self, options):
        assert options is getattr(self, "options", events._IPC)
        if self.error is not None:
            raise self.error
        if self.refusals:
            self.refusals -= 1
            self.steps.append("refused")
            raise cuda_failure("cuEventRecord")
        self.steps.append("recorded")
        return Event(self.steps)


@pytest.fixture
def steps(monkeypatch):
    steps = []

    @contextlib.contextmanager
    def on_stream(stream):
        steps.append("switch")
        yield

    monkeypatch.setattr(events, "OnStream", on_stream)
    monkeypatch.setattr(events, "event_handle", lambda handle: bytes([handle]) * 64)
    return steps


def test_an_event_is_recorded_in_the_current_context_without_a_switch(steps):
    event, handle = events.record_ipc(Stream(steps, refusals=0))
    assert steps == ["recorded"] and handle == bytes([7]) * 64 and event.handle == 7


def test_a_stream_of_another_context_gets_the_event_made_in_its_own(steps):
    events.record_ipc(Stream(steps, refusals=1))
    assert steps == ["refused", "switch", "recorded"]


def test_a_failure_that_is_not_the_driver_s_is_not_retried(steps):
    with pytest.raises(TypeError, match="a bug"):
        events.record_ipc(Stream(steps, refusals=0, error=TypeError("a bug")))
    assert steps == []


def test_a_handle_that_cannot_be_read_closes_the_event(steps, monkeypatch):
    def no_handle(handle):
        raise cuda_failure("cuIpcGetEventHandle")

    monkeypatch.setattr(events, "event_handle", no_handle)
    with pytest.raises(IpcPoolError, match="cuIpcGetEventHandle failed"):
        events.record_ipc(Stream(steps, refusals=0))
    assert steps == ["recorded", "close"]


def test_a_peer_event_is_opened_again_in_the_stream_s_context_where_the_current_one_is_refused(steps, monkeypatch):
    refusals = [1]

    class Opened:
        handle = 9

        def close(self):
            steps.append("closed")

    def record(event, stream):
        if refusals[0]:
            refusals[0] -= 1
            return (events.CUresult.CUDA_ERROR_INVALID_HANDLE,)
        steps.append("recorded")
        return (events.CUresult.CUDA_SUCCESS,)

    monkeypatch.setattr(events, "open_ipc", lambda handle: steps.append("opened") or Opened())
    monkeypatch.setattr(events, "cuEventRecord", record)
    events.record_into(type("S", (), {"handle": 3})(), bytes(64))
    assert steps == ["opened", "closed", "switch", "opened", "recorded", "closed"]


def test_a_marker_on_a_stream_of_another_context_is_made_in_its_own(steps):
    """The broker's done markers and graves: its current device is the last it switched to."""
    stream = Stream(steps, refusals=1)
    stream.options = events._PLAIN
    assert events.record_marker(stream).handle == 7
    assert steps == ["refused", "switch", "recorded"]


class Kept:
    """An event the graveyard keeps: ``done`` says whether its work has completed (a query)."""

    def __init__(self, steps, done, failure=None):
        self.steps, self.done, self.failure = steps, done, failure

    @property
    def is_done(self):
        if self.failure is not None:
            raise self.failure
        return self.done

    def close(self):
        self.steps.append("closed")


def test_events_complete_when_buried_are_dropped_with_no_marker_on_the_gpu(steps):
    """A freed hand-off range retires its seal's credit, long complete: no record, query and destroy
    of a marker per hand-off."""
    graves, stream = events.Graveyard(), Stream(steps, refusals=0)
    stream.options = events._PLAIN
    graves.bury(stream, Kept(steps, True), Kept(steps, True))
    assert steps == ["closed", "closed"] and len(graves) == 0


def test_a_pending_event_waits_for_a_marker_and_goes_once_it_passed(steps):
    graves, stream = events.Graveyard(), Stream(steps, refusals=0)
    stream.options = events._PLAIN
    pending = Kept(steps, False)
    graves.bury(stream, Kept(steps, True), pending)
    assert steps == ["recorded"] and len(graves) == 1   # nothing closed: the pending one may be waited on
    marker = graves._graves[0][0]
    marker.is_done = False
    assert graves.sweep() == 0 and steps == ["recorded"]
    marker.is_done = True
    assert graves.sweep() == 1 and steps == ["recorded", "close", "closed", "closed"]


def test_an_event_whose_query_fails_is_buried_behind_a_marker_as_before(steps):
    graves, stream = events.Graveyard(), Stream(steps, refusals=0)
    stream.options = events._PLAIN
    graves.bury(stream, Kept(steps, True, failure=cuda_failure("cuEventQuery")))
    assert steps == ["recorded"] and len(graves) == 1
    with pytest.raises(TypeError, match="a bug"):   # (not the driver's: raised, nothing closed)
        graves.bury(stream, Kept(steps, True, failure=TypeError("a bug")))
    assert steps == ["recorded"]


def test_what_is_not_an_event_is_buried_behind_a_marker(steps):
    graves, stream = events.Graveyard(), Stream(steps, refusals=0)
    stream.options = events._PLAIN
    graves.bury(stream, type("Mapping", (), {"close": lambda self: steps.append("closed")})())
    assert steps == ["recorded"] and len(graves) == 1
