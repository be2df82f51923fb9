"""The broker's garbage collector runs between requests (``broker.collector``): off while it serves,
a collection once past the young threshold after a request, a create collecting only far past it,
and the collector as it was once the loop ends."""

import gc

import pytest

from ipcpool.broker import collector


@pytest.fixture
def serving():
    collector.start()
    try:
        yield
    finally:
        collector.stop()


def garbage(n):
    """``n`` container objects kept alive (they count as allocations until collected)."""
    return [[] for _ in range(n)]


def test_serving_turns_automatic_collection_off_and_stopping_turns_it_back_on(serving):
    assert not gc.isenabled()
    assert gc.get_freeze_count() > 0   # what start made is never walked again
    collector.stop()
    assert gc.isenabled() and gc.get_freeze_count() == 0
    collector.start()   # (for the fixture's stop)


def test_a_request_past_the_threshold_collects_and_a_create_waits_longer(serving):
    threshold = gc.get_threshold()[0]
    keep = garbage(2 * threshold)
    assert gc.get_count()[0] >= 2 * threshold   # nothing collected them: automatic collection is off
    collector.in_create()
    assert gc.get_count()[0] >= 2 * threshold   # a create leaves them: not far enough past
    collector.between_requests()
    assert gc.get_count()[0] < threshold        # after another request: collected
    keep += garbage(collector.CREATE_SLACK * threshold)
    collector.in_create()
    assert gc.get_count()[0] < threshold        # far past it, a create collects too
    del keep
