"""FD helpers for the tests that check nothing is left open."""

import os


def is_open(fd: int) -> bool:
    """Whether ``fd`` is still an open descriptor of this process."""
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def fd_count(pid: int) -> int:
    """How many descriptors process ``pid`` has open."""
    return len(os.listdir(f"/proc/{pid}/fd"))
