"""Who may use the broker: filesystem permissions first, then the uid/gid allow-list."""

import os
import shutil
import tempfile
from pathlib import Path

import pytest

import ipcpool
from tests.support.uids import NOBODY, connected_as


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="runs a client as another uid")


@pytest.fixture
def open_dir():
    """A socket directory another uid can traverse (pytest's tmp dirs are private)."""
    d = Path(tempfile.mkdtemp(prefix="ipcpool-access-"))
    os.chmod(d, 0o711)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def as_nobody(socket_dir) -> str:
    """Connect as uid/gid nobody; "OK <sessions>" or the error."""
    return connected_as(socket_dir, NOBODY, NOBODY, [], lambda c: f"OK {c.stats()['sessions']}")


@needs_root
def test_sockets_are_private_by_default(start_broker, open_dir):
    b = start_broker(socket_dir=open_dir / "s")
    assert (os.stat(b.socket_dir).st_mode & 0o777) == 0o750
    assert (os.stat(b.socket_dir / "broker.sock").st_mode & 0o777) == 0o660
    out = as_nobody(b.socket_dir)
    assert out.startswith("PeerRefused permission denied"), out


@needs_root
def test_uid_not_on_the_allow_list_is_refused(start_broker, open_dir):
    b = start_broker(socket_dir=open_dir / "s")
    os.chmod(b.socket_dir, 0o755)                   # let it reach the socket: the broker must refuse
    os.chmod(b.socket_dir / "broker.sock", 0o666)
    out = as_nobody(b.socket_dir)
    assert out.startswith(f"PeerRefused uid {NOBODY}") and "not allowed" in out, out
    assert "refused pid" in b.log()
    with ipcpool.connect(b.socket_dir) as c:         # root still is allowed, nothing leaked
        assert c.stats()["sessions"] == 1


@needs_root
def test_allow_listed_uid_is_served(start_broker, open_dir):
    b = start_broker(socket_dir=open_dir / "s", config_text=f"[access]\nuids = [0, {NOBODY}]\n")
    os.chmod(b.socket_dir, 0o755)
    os.chmod(b.socket_dir / "broker.sock", 0o666)
    out = as_nobody(b.socket_dir)       # the message channel is still 0660: told plainly
    assert out.startswith("PeerRefused permission denied") and "message channel" in out, out
    os.chmod(b.socket_dir / "broker.zmq", 0o666)
    assert as_nobody(b.socket_dir) == "OK 1"


def as_user(socket_dir, uid: int, gid: int, groups: list[int]) -> str:
    """Connect as ``uid`` with primary ``gid`` and ``groups``, allocate and write; "OK <sessions>
    <uid> <groups>" or the error."""
    def act(c) -> str:
        with c.allocate(4096) as buf:
            buf.view[:2] = b"hi"
            return f"OK {c.stats()['sessions']} {os.getuid()} {sorted(os.getgroups())}"

    return connected_as(socket_dir, uid, gid, groups, act)


GRANTED = 23456    # the group [access] lists ("ipcpool" on a real system)
ALICE = 12345      # a user whose primary group is her own


@needs_root
def test_a_supplementary_group_grants_access(start_broker, open_dir):
    sd = open_dir / "s"
    sd.mkdir()
    os.chown(sd, 0, GRANTED)
    os.chmod(sd, 0o2750)     # the sockets take the directory's group: reachable by GRANTED only
    b = start_broker(socket_dir=sd, config_text=f"[access]\nuids = [0]\ngids = [{GRANTED}]\n")
    assert os.stat(b.socket_dir / "broker.sock").st_gid == GRANTED
    with ipcpool.connect(b.socket_dir):   # (imports what the child needs before it drops root)
        pass
    out = as_user(b.socket_dir, ALICE, ALICE, [ALICE, GRANTED])
    assert out == f"OK 1 {ALICE} {sorted([ALICE, GRANTED])}", out
    # The same user without the group: the filesystem lets her reach the socket, the broker refuses.
    os.chmod(b.socket_dir, 0o2755)
    os.chmod(b.socket_dir / "broker.sock", 0o666)
    out = as_user(b.socket_dir, ALICE, ALICE, [ALICE])
    assert out.startswith(f"PeerRefused uid {ALICE}") and "not allowed" in out, out
    assert "refused pid" in b.log() and f"uid {ALICE}" in b.log()
    with ipcpool.connect(b.socket_dir) as c:
        assert c.stats()["sessions"] == 1 and c.stats()["pools"]["default"]["used"] == 0
