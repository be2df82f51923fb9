"""The CUDA client's context switching, as pure logic: the driver calls are stand-ins here (the
GPU suite exercises the real ones)."""

import pytest

cuda = pytest.importorskip("ipcpool.backend.cuda.context", exc_type=ImportError)


class FakeDriver:
    def __init__(self, current):
        self.current = current
        self.sets = []

    def current_context(self):
        return self.current

    def restore_context(self, ctx):
        self.sets.append(ctx)
        self.current = ctx

    def stream_context(self, handle):
        return 500 + handle


class FakeDevice:
    retained = []

    def __init__(self, ordinal, drv):
        self.ordinal, self.drv = ordinal, drv

    def set_current(self):
        FakeDevice.retained.append(self.ordinal)
        self.drv.current = 100 + self.ordinal


@pytest.fixture
def drv(monkeypatch):
    d = FakeDriver(current=7)   # the caller's own context
    monkeypatch.setattr(cuda, "drv", d)
    monkeypatch.setattr(cuda, "Device", lambda ordinal: FakeDevice(ordinal, d))
    monkeypatch.setattr(cuda.OnDevice, "_primary", {})
    FakeDevice.retained = []
    return d


def test_on_device_retains_once_and_gives_the_caller_its_context_back(drv):
    for _ in range(3):
        with cuda.OnDevice(1):
            assert drv.current == 101
        assert drv.current == 7
    assert FakeDevice.retained == [1]          # retained once, then switched to by handle


def test_on_stream_uses_the_streams_context_and_leaves_default_streams_alone(drv):
    class S:
        def __init__(self, handle):
            self.handle = handle

    with cuda.OnStream(S(1)):                 # the legacy default stream: no switch
        assert drv.current == 7
    with cuda.OnDevice(0), cuda.OnStream(S(42)):
        assert drv.current == 542
    assert drv.current == 7


def test_no_switch_no_restore_and_a_thread_without_a_context_keeps_the_one_it_got(drv):
    with cuda.OnDevice(1):
        pass
    drv.current, drv.sets = 101, []           # device 1's context is the caller's own now
    with cuda.OnDevice(1):
        assert drv.current == 101
    assert drv.sets == []                     # neither a switch nor a restore
    drv.current = 0                           # a thread that had no context
    with cuda.OnDevice(1):
        assert drv.current == 101
    assert drv.sets == [101] and drv.current == 101
