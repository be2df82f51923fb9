"""Fixtures that run real brokers and real client processes (spawn), and kill what gets stuck.
The helpers they use, and that tests import, live in tests/support/."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.broker import BrokerProc


@pytest.fixture
def start_broker(tmp_path_factory):
    """Factory: ``start_broker(backend="host", config_text=None, socket_dir=None)``."""
    started: list[BrokerProc] = []

    def start(backend: str = "host", config_text: str | None = None, socket_dir: Path | None = None,
              wait: bool = True, env: dict[str, str] | None = None) -> BrokerProc:
        base = tmp_path_factory.mktemp("broker")
        b = BrokerProc(socket_dir or base / "sock", backend, config_text, base / "broker.log", env)
        started.append(b)
        try:
            return b.wait_ready() if wait else b
        except RuntimeError:   # it never served: the test gets the reason in this error, not a crash
            b.killed = True
            raise

    yield start
    crashed = []
    for b in started:
        exited_by_itself = b.proc.poll() is not None
        code = b.stop()
        # A broker stopped with SIGTERM exits 0; anything else (an exit of its own with another
        # status, a signal, a hang past SIGTERM) is a crash the test must not hide, unless the test
        # staged it with BrokerProc.kill().
        if code != 0 and not b.killed:
            how = "exited by itself" if exited_by_itself else "did not stop cleanly on SIGTERM"
            crashed.append(f"broker pid {b.pid} {how} with status {code}; its log:\n{b.log()[-4000:]}")
    assert not crashed, "\n".join(crashed)


@pytest.fixture
def start_fleet(start_broker, tmp_path):
    """Factory: ``start_fleet(backend="host", serve=("",), serve_env=None)``: two brokers, the
    first served to the second by `ipcpool serve-peer` (tests/support/fleet.py). Skips without NIXL."""
    from ipcpool.fleet import nixl
    from tests.support.fleet import Fleet

    if not nixl.available():
        pytest.skip("NIXL is not installed (pip install --no-deps nixl-cu13==1.5.1; `make venv` does)")
    made: list[Fleet] = []

    def start(backend: str = "host", serve: tuple[str, ...] = ("",), serve_env: dict | None = None) -> Fleet:
        made.append(Fleet(start_broker, tmp_path, backend, serve, serve_env))
        return made[-1]

    yield start
    for f in made:
        f.close()


@pytest.fixture
def broker(start_broker) -> BrokerProc:
    return start_broker()
