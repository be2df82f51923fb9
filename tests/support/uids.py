"""Acting as another user: a forked child that drops its credentials, runs a callable and reports
what it returned (or the error it raised) as text. A fork, since the interpreter lives under a
private home: a fresh exec as another user could not start Python."""

import os

import ipcpool

NOBODY = 65534


def forked_as(uid: int, gid: int, groups: list[int], act, catch=(ipcpool.IpcPoolError,)) -> str:
    """``act()`` in a child that dropped to ``uid``, primary ``gid`` and supplementary ``groups``
    (set in that order: setgroups, setgid, setuid, as ``usermod -aG`` and a new login would leave
    them): what it returns, or ``"<ErrorType> <message>"`` for an error of ``catch``."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        try:
            os.close(r)
            os.setgroups(groups)
            os.setgid(gid)
            os.setuid(uid)
            try:
                out = act()
            except catch as e:
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


def connected_as(socket_dir, uid: int, gid: int, groups: list[int], act, timeout: float = 10,
                 catch=(ipcpool.IpcPoolError,)) -> str:
    """``forked_as`` with a client: what ``act(client)`` says, or the error."""
    def run() -> str:
        with ipcpool.connect(socket_dir, timeout=timeout) as c:
            return act(c)
    return forked_as(uid, gid, groups, run, catch)
