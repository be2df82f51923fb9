"""A stand-in for systemd's part in durable memory: the notify socket with its FD store, and
starting the next broker with the stored FDs (LISTEN_FDS), as after a crash."""

import array
import os
import socket
import subprocess
import threading
import time


class FdStore:
    """What systemd does with FDSTORE=1 / FDSTOREREMOVE=1 messages, reduced to a dict."""

    def __init__(self, path):
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.05)
        self.fds: dict[str, int] = {}
        self.ready = threading.Event()
        self._stop = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve, daemon=True)   # systemd reads at once
        self._thread.start()

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.fds)

    def names_when(self, check, timeout: float = 10.0) -> set[str]:
        """The stored names once ``check(names)`` holds (the datagrams are read by a thread, so
        the last few may still be in flight), or as they are at the timeout."""
        deadline = time.monotonic() + timeout
        while not check(names := set(self.snapshot())) and time.monotonic() < deadline:
            time.sleep(0.01)
        return names

    def _serve(self):
        while not self._stop:
            try:
                data, anc, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(16 * 4))
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                self._take(data, anc)

    def _take(self, data, anc):
        fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
        fds = []
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.extend(array.array("i", payload[: len(payload) - len(payload) % 4]))
        if fields.get("FDSTORE") == "1" and fds:
            name = fields["FDNAME"]
            if name in self.fds:            # systemd ignores a second copy of a stored file
                os.close(fds[0])
            else:
                self.fds[name] = fds[0]
        elif fields.get("FDSTOREREMOVE") == "1":
            fd = self.fds.pop(fields["FDNAME"], None)
            if fd is not None:
                os.close(fd)
        else:
            for fd in fds:
                os.close(fd)
        if fields.get("READY") == "1":
            self.ready.set()


    def close(self):
        self._stop = True
        self._thread.join(5)
        for fd in self.fds.values():
            os.close(fd)
        self.sock.close()


def launch_with_fds(store: FdStore):
    """A launcher that starts a broker as systemd would after a crash: the stored FDs as 3, 4, ...
    and LISTEN_FDS, LISTEN_FDNAMES, LISTEN_PID (the pid known only once forked: set by a shell
    that then execs the broker in its place)."""
    stored = store.snapshot()
    names = list(stored)
    fds = [stored[n] for n in names]

    def place_fds():   # in the child, before exec: move them to 3.. (via high numbers, no clash)
        high = [os.dup2(os.dup(fd), 200 + i) for i, fd in enumerate(fds)]
        for i, h in enumerate(high):
            os.dup2(h, 3 + i)

    def launch(args, env, **kw):
        env = {**env, "LISTEN_FDS": str(len(fds)), "LISTEN_FDNAMES": ":".join(names)}
        wrapped = ["/bin/sh", "-c", 'LISTEN_PID=$$; export LISTEN_PID; exec "$0" "$@"', *args]
        return subprocess.Popen(wrapped, env=env, preexec_fn=place_fds,
                                pass_fds=tuple(range(3, 3 + len(fds))), **kw)

    return launch
