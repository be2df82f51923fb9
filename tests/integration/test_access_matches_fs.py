"""What [access] admits, the filesystem lets through; and a refusal says which of the two refused."""

import os
import shutil
import tempfile
from pathlib import Path

import pytest

import ipcpool
from ipcpool import paths
from tests.support.uids import NOBODY, forked_as

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="runs a client as another uid")

GRANTED = 23457   # the group [access] lists ("ipcpool" on a real system)
ALICE = 12346


@pytest.fixture
def open_dir():
    """A directory other uids can traverse (pytest's tmp dirs are private)."""
    d = Path(tempfile.mkdtemp(prefix="ipcpool-fs-"))
    os.chmod(d, 0o711)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _stats(socket_dir):
    def act() -> str:
        with ipcpool.connect(socket_dir, timeout=10) as c:
            return f"OK {c.stats()['sessions']}"
    return act


def test_a_group_under_access_reaches_the_sockets_and_a_refusal_says_who_refused(start_broker, open_dir):
    b = start_broker(socket_dir=open_dir / "s", config_text=f"[access]\nuids = [0]\ngroups = [{GRANTED}]\n")
    st = os.stat(b.socket_dir)
    assert st.st_gid == GRANTED and st.st_mode & 0o777 == 0o750
    assert os.stat(b.socket_dir / "broker.sock").st_gid == GRANTED
    assert os.stat(b.socket_dir / "broker.zmq").st_gid == GRANTED
    with ipcpool.connect(b.socket_dir):   # (imports what the child needs before it drops root)
        pass
    assert forked_as(ALICE, ALICE, [ALICE, GRANTED], _stats(b.socket_dir)) == "OK 1"
    out = forked_as(ALICE, ALICE, [ALICE], _stats(b.socket_dir))    # not in the group: the filesystem says no
    assert out.startswith("PeerRefused permission denied") and "the filesystem refused" in out, out
    assert f"of group {GRANTED}, which this process is not in" in out and f"to group {GRANTED}" in out, out


def test_socket_mode_opens_the_directory_and_then_the_config_refuses(start_broker, open_dir):
    b = start_broker(socket_dir=open_dir / "s", config_text='socket_mode = "0755"\nsocket_group = ""\n')
    assert os.stat(b.socket_dir).st_mode & 0o777 == 0o755
    assert os.stat(b.socket_dir / "broker.sock").st_mode & 0o777 == 0o666
    out = forked_as(NOBODY, NOBODY, [], _stats(b.socket_dir))
    assert out.startswith(f"PeerRefused uid {NOBODY}") and "its config refused it" in out, out


def test_a_system_directory_closed_to_us_says_what_to_do(monkeypatch, open_dir):
    closed = open_dir / "run-ipcpool"
    closed.mkdir(mode=0o700)
    monkeypatch.setattr(paths, "SYSTEM_DIR", closed)
    monkeypatch.delenv("IPCPOOL_SOCKET_DIR", raising=False)
    out = forked_as(NOBODY, NOBODY, [], lambda: str(ipcpool.connect(timeout=1)))
    assert out.startswith(f"PeerRefused permission denied on {closed}"), out
    assert "add this user to that group" in out and "IPCPOOL_SOCKET_DIR" in out, out
