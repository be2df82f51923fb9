"""A CUDA session's handed-out events (R4), as pure logic: streams and events are stand-ins here
(the GPU suite exercises the real ones)."""

import pytest

session = pytest.importorskip("ipcpool.backend.cuda.session", exc_type=ImportError)


class Marker:
    def __init__(self, stream):
        self.stream = stream

    @property
    def is_done(self):
        return not self.stream.busy

    def close(self):
        pass


class FakeStream:
    def __init__(self, busy=False):
        self.busy = busy
        self.records = 0

    def record(self, options=None):
        self.records += 1
        return Marker(self)


class Event:
    closed = False

    def close(self):
        self.closed = True


class Backend:
    def sweep(self):
        pass

    def keep_graveyard(self, graveyard):
        pass


def test_a_handed_out_event_outlives_the_message_that_handed_it_out():
    s = session.CudaSession(Backend())
    stream = FakeStream()   # idle: a marker recorded there is done at once
    s._streams = {0: stream}
    event = Event()
    s.hand_out(stream, event)
    s.peer_progressed()      # the end of the message whose reply names the event
    assert not event.closed  # the client has not had the reply yet
    s.peer_progressed()      # its next message: it has opened the event by then
    assert event.closed


def test_a_handed_out_event_is_retired_on_the_stream_it_was_recorded_on():
    s = session.CudaSession(Backend())
    first, other = FakeStream(), FakeStream(busy=True)   # the event's device is still working
    s._streams = {0: first, 1: other}
    event = Event()
    s.hand_out(other, event)
    s.peer_progressed()
    s.peer_progressed()
    assert (first.records, other.records) == (0, 1)
    assert not event.closed   # its stream has not passed it
    other.busy = False
    s.peer_progressed()
    assert event.closed
