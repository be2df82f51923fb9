"""FD helpers shared by the tests that check nothing is left open."""

import os


def is_open(fd: int) -> bool:
    """Whether ``fd`` is still an open descriptor of this process."""
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False
