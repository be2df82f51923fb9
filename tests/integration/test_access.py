"""Who may use the broker: filesystem permissions first, then the uid/gid allow-list."""

import os
import shutil
import tempfile
from pathlib import Path

import pytest

import ipcpool

NOBODY = 65534

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="runs a client as another uid")


@pytest.fixture
def open_dir():
    """A socket directory another uid can traverse (pytest's tmp dirs are private)."""
    d = Path(tempfile.mkdtemp(prefix="ipcpool-access-"))
    os.chmod(d, 0o711)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _forked_as(socket_dir, uid: int, gid: int, groups: list[int], act) -> str:
    """Connect from a forked child that dropped to ``uid``, primary ``gid`` and supplementary
    ``groups`` (set in that order: setgroups, setgid, setuid, as ``usermod -aG`` and a new login
    would leave them) and return what ``act(client)`` says, or the error. A fork, since the
    interpreter lives under a private home: a fresh exec as another user could not start Python."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        try:
            os.close(r)
            os.setgroups(groups)
            os.setgid(gid)
            os.setuid(uid)
            try:
                with ipcpool.connect(socket_dir, timeout=10) as c:
                    out = act(c)
            except ipcpool.IpcPoolError as e:
                out = f"{type(e).__name__} {e}"
            os.write(w, out.encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        out = f.read().decode()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    return out


def as_nobody(socket_dir) -> str:
    """Connect as uid/gid nobody; "OK <sessions>" or the error."""
    return _forked_as(socket_dir, NOBODY, NOBODY, [], lambda c: f"OK {c.stats()['sessions']}")


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

    return _forked_as(socket_dir, uid, gid, groups, act)


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
