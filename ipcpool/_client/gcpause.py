"""The cyclic garbage collector held off while a batch attach builds its objects.

A thousand-object attach makes several objects per lease (the decoded reply, exports, imports,
Buffers, arrays), every one of them live: the young-generation collections they set off find
nothing to free, yet each walks what was made so far, and one may reach the oldest generation
(every object the process has, tens of thousands after torch or numpy is imported). Measured on
the host backend, that was a fifth to a third of a fresh process's attach of 4096 objects. The
collector is paused for the attach only, and resumed as it was (a process that turned it off
keeps it off); the collection it would have run comes at the next allocation after, once.
The switch is the process's: a thread that turns the collector off while another thread's attach
holds it paused finds it on again when that attach ends.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def paused() -> Iterator[None]:
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
