"""The broker's graveyard on real events: what has completed goes at once, with no command of the
broker's on the GPU; what is pending waits for a marker on its stream."""

import pytest

pytestmark = pytest.mark.gpu


class Watched:
    """A real event, its close seen."""

    def __init__(self, event):
        self.event, self.closed = event, False

    @property
    def is_done(self):
        return self.event.is_done

    def close(self):
        self.closed = True
        self.event.close()


def test_a_complete_event_goes_at_once_and_a_pending_one_after_its_marker():
    import cupy
    from cuda.core import Device, Stream

    from ipcpool.backend.cuda.events import Graveyard, record_marker
    from tests.support.kernels import spin_fill

    Device(0).set_current()
    graves = Graveyard()
    spinning = cupy.cuda.Stream(non_blocking=True)
    stream = Stream.from_handle(spinning.ptr)
    done = Watched(record_marker(stream))
    stream.sync()
    graves.bury(stream, done)
    assert done.closed and len(graves) == 0

    scratch = cupy.zeros(1 << 20, dtype=cupy.uint8)
    spin_fill(scratch.data.ptr, scratch.size, 0.5, 7, spinning)
    pending = Watched(record_marker(stream))
    graves.bury(stream, pending)
    assert not pending.closed and len(graves) == 1
    assert graves.sweep() == 0 and not pending.closed   # the kernel still spins
    stream.sync()
    assert graves.sweep() == 1 and pending.closed and int(scratch[0].get()) == 7
