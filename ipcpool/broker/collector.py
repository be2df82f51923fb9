"""The broker's cyclic garbage collector, run between requests rather than inside one.

Left automatic, Python collects once allocations pass a threshold: in the middle of whichever
request made the last one. On a 2-CPU host, in a steady hand-off, a young collection cost the
broker ~70 µs every ~45 hand-offs and an older one ~0.8 ms every ~600: landing in a create before
its directory entry, a reader waits that long. So the broker turns automatic collection off and
collects, by the automatic rule's thresholds, right after it answered a request other than a
create (a hand-off's seal, release and delete come while no reader waits on the broker), and when
it is about to sleep. A create collects only far past the threshold (a burst of nothing but
creates), so garbage never grows without bound. The objects made at start (modules, the
configuration, the backend) are frozen first: no later collection walks them.
"""

from __future__ import annotations

import gc

CREATE_SLACK = 16   # a create collects only past this many times the young threshold


def start() -> None:
    gc.collect()
    gc.freeze()
    gc.disable()


def stop() -> None:
    gc.unfreeze()
    gc.enable()


def between_requests() -> None:
    """After a request other than a create, or before the loop sleeps."""
    if gc.get_count()[0] >= gc.get_threshold()[0]:
        _collect()


def in_create() -> None:
    if gc.get_count()[0] >= CREATE_SLACK * gc.get_threshold()[0]:
        _collect()


def _collect() -> None:
    """The generation the automatic rule would collect now (an older one once enough younger
    collections ran), and the younger ones with it."""
    _, count1, count2 = gc.get_count()
    _, threshold1, threshold2 = gc.get_threshold()
    gc.collect(2 if count1 >= threshold1 and count2 >= threshold2 else 1 if count1 >= threshold1 else 0)
