"""Two brokers on one machine as two nodes of a fleet: "a" serves (`ipcpool serve-peer`), "b"
pulls (`ipcpool pull`); each has its own socket directory and NIXL listener port."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import numpy as np

import ipcpool
from tests.support.broker import terminate
from tests.support.cli import IPCPOOL, ipcpool_cmd
from tests.support.safetensors import sample_tensors, write_safetensors


def model(tmp_path, seed=0, big=3 << 20):
    """The sample tensors and one of ``big`` bytes: a file to load and what it holds."""
    tensors = {**sample_tensors(seed), "big": np.random.default_rng(seed).standard_normal(big // 4).astype(np.float32)}
    path = tmp_path / f"m{seed}.safetensors"
    write_safetensors(path, tensors)
    return path, tensors


def pool_used(socket_dir):
    with ipcpool.connect(socket_dir) as c:
        return c.stats()["pools"]["default"]["used"]


def settled_used(socket_dir, base: int, timeout: float = 15.0) -> int:
    """The pool's used bytes once back to ``base`` (frees of a dead writer's memory may be deferred
    behind its process's exit and, on CUDA, its streams), or as they are after ``timeout``."""
    deadline = time.monotonic() + timeout
    while (used := pool_used(socket_dir)) != base and time.monotonic() < deadline:
        time.sleep(0.05)
    return used


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_config(name: str, port: int, peer: str, peer_port: int, serve: tuple[str, ...] = ()) -> str:
    serve_line = f"serve = {list(serve)!r}\n".replace("'", '"') if serve else ""
    return f'[nixl]\nname = "{name}"\nport = {port}\n{serve_line}\n[peers]\n{peer} = "127.0.0.1:{peer_port}"\n'


class ServePeer:
    """`ipcpool serve-peer` for one broker, ready once it says what it serves."""

    def __init__(self, socket_dir: Path, config: Path, log: Path, env: dict[str, str] | None = None):
        self.log_path = log
        self._log = open(log, "wb")
        self.proc = subprocess.Popen([*IPCPOOL, "serve-peer", "--socket-dir", str(socket_dir), "--config", str(config)],
                                     stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 60.0) -> ServePeer:
        deadline = time.monotonic() + timeout
        while "serving checkpoints" not in self.log():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"serve-peer not ready (exit {self.proc.poll()}):\n{self.log()}")
            time.sleep(0.05)
        return self

    def stop(self) -> int:
        code = terminate(self.proc)
        self._log.close()
        return code


class Fleet:
    """Broker "a" with its serve-peer, broker "b"; ``pull(...)`` runs `ipcpool pull` on b."""

    def __init__(self, start_broker, tmp: Path, backend: str = "host", serve: tuple[str, ...] = ("",),
                 serve_env: dict[str, str] | None = None):
        pa, pb = free_port(), free_port()
        self.a_config, self.b_config = tmp / "a.toml", tmp / "b.toml"
        self.a_config.write_text(node_config("a", pa, "b", pb, serve))
        self.b_config.write_text(node_config("b", pb, "a", pa))
        self.a = start_broker(backend=backend)
        self.b = start_broker(backend=backend)
        self.server = ServePeer(self.a.socket_dir, self.a_config, tmp / "serve-peer.log", serve_env).wait_ready()

    def pull_args(self, *args: str) -> list[str]:
        return ["pull", "--socket-dir", str(self.b.socket_dir), "--config", str(self.b_config), *args]

    def pull(self, *args: str, env: dict[str, str] | None = None, timeout: float = 120):
        return ipcpool_cmd(*self.pull_args(*args), timeout=timeout, env={**os.environ, **(env or {})})

    def close(self) -> None:
        code = self.server.stop()
        assert code == 0, f"serve-peer exited {code}:\n{self.server.log()}"
