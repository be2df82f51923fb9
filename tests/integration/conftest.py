"""Fixtures of the integration tests (the broker fixtures are in tests/conftest.py)."""

import pytest

from tests.support import raw


@pytest.fixture
def raw_session(broker):
    """A session opened by hand: (control socket, DEALER with the session token)."""
    with raw.raw_session(broker) as session:
        yield session
