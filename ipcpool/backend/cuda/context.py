"""Which CUDA context is current: set once per thread on the broker, switched for one call and then
given back on the client (a torch or cupy user on another device must not find its device changed).
"""

from __future__ import annotations

import threading
from typing import Any

from cuda.core import Device, Stream

from ...errors import BackendUnavailable
from . import driver as drv

_tls = threading.local()


def make_current(device_id: int) -> Device:
    """Make ``device_id``'s primary context current on this thread (cheap once done)."""
    current = getattr(_tls, "devices", None)
    if current is None:
        current = _tls.devices = {}
    dev = current.get(device_id)
    if dev is None or getattr(_tls, "last", None) != device_id:
        dev = Device(device_id)
        dev.set_current()
        current[device_id] = dev
        _tls.last = device_id
    return dev


class SwitchContext:
    """Make a context current for one call, then give the caller back its own (a torch or cupy
    user on another device must not find its current device changed). What runs inside leaves
    the context as it found it (a switch of its own is another SwitchContext), so that where
    no switch was needed the exit asks the driver nothing: a grow enters several of these."""

    __slots__ = ("prev", "switched")

    def _target(self) -> Any:
        """The context to switch to, or None to stay in the current one."""
        raise NotImplementedError

    def __enter__(self) -> None:
        self.prev = drv.current_context()
        ctx = self._target()
        self.switched = ctx is not None and int(ctx) != int(self.prev)
        if self.switched:
            drv.restore_context(ctx)

    def __exit__(self, *exc: Any) -> None:
        # A thread that had no context keeps the one it was given (see CudaClientBackend).
        if self.switched and int(self.prev) != 0:
            drv.restore_context(self.prev)


class OnDevice(SwitchContext):
    """Client side: the pool's device's primary context."""

    __slots__ = ("device",)
    # Each device's primary context, once retained. Device.set_current() retains it again on every
    # call (~0.4 ms measured on an H100); switching to a known context is one cheap driver call.
    _primary: dict[int, Any] = {}

    def __init__(self, device: int):
        self.device = device

    def _target(self) -> Any:
        ctx = self._primary.get(self.device)
        if ctx is None:
            Device(self.device).set_current()
            ctx = self._primary[self.device] = drv.current_context()
        return ctx


class OnStream(SwitchContext):
    """The context of ``stream``, for events recorded on or waited on by it: a caller's stream may
    belong to another device than the pool (peer access), and an event made in one context cannot
    be recorded on a stream of another."""

    __slots__ = ("stream",)

    def __init__(self, stream: Stream):
        self.stream = stream

    def _target(self) -> Any:
        handle = int(self.stream.handle)
        # the default streams (0-2) follow the current context
        return drv.stream_context(handle) if handle > 2 else None


def check_device(device: int) -> None:
    count = drv.device_count()
    if not 0 <= device < count:
        raise BackendUnavailable(f"CUDA device {device} does not exist (this machine has {count})")
