"""fdpass.presize_table in fresh processes: the kernel's table of open files grows now, to the
slots asked for or the soft RLIMIT_NOFILE, and no FD is left open."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ipcpool import fdpass

_PROBE = """
import json, os, resource, sys
from ipcpool import fdpass
if len(sys.argv) > 2:
    resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[2]), resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
def slots():
    return int(next(l.split()[1] for l in open("/proc/self/status") if l.startswith("FDSize:")))
before, open_before = slots(), len(os.listdir("/proc/self/fd"))
fd = os.open("/dev/null", os.O_RDONLY)
asked = fdpass.presize_table(fd, int(sys.argv[1]))
os.close(fd)
print(json.dumps({"before": before, "after": slots(), "asked": asked,
                  "leaked": len(os.listdir("/proc/self/fd")) - open_before}))
"""


def _probe(*args: int) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE, *map(str, args)], capture_output=True, text=True,
                         timeout=60, check=True)
    return json.loads(out.stdout)


def _soft_limit() -> int:
    import resource

    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


@pytest.mark.skipif(_soft_limit() < 1024, reason="needs a soft open-file limit of 1024")
def test_the_table_grows_to_the_slots_asked_and_keeps_no_fd():
    got = _probe(1000)
    assert got["before"] < 1000, got   # a fresh interpreter starts small (64 on Linux)
    assert got["after"] >= 1000 and got["asked"] == 1000 and got["leaked"] == 0, got


def test_the_soft_limit_caps_the_table():
    got = _probe(100_000, 200)
    assert got["asked"] == 200 and got["leaked"] == 0, got
    assert 200 <= got["after"] < 1000, got   # the kernel rounds up (256), far below what was asked


def test_a_table_already_big_enough_is_left_as_it_is():
    got = _probe(10)
    assert got["after"] == got["before"] and got["leaked"] == 0, got


def test_a_closed_fd_raises_nothing():
    import os

    fd = os.open("/dev/null", os.O_RDONLY)
    os.close(fd)
    assert fdpass.presize_table(fd, 4096) >= 1   # EBADF: the table grows when it must instead
