"""Waiting in a test for something another process or thread does."""

import time


def wait_for(pred, timeout=5.0):
    """Until ``pred()`` holds; fails the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)
