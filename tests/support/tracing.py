"""Trace callbacks a test's broker loads (``IPCPOOL_TRACE=tests.support.tracing:NAME``, with the
repository on its PYTHONPATH): ``broker_env`` gives the environment."""

from __future__ import annotations

import json
import os
from pathlib import Path

FILE_ENV = "IPCPOOL_TEST_TRACE_FILE"
ROOT = Path(__file__).resolve().parents[2]


def broker_env(callback: str, path: Path | None = None) -> dict[str, str]:
    """The environment of a broker that subscribes ``callback`` of this module (its events to ``path``)."""
    env = {"IPCPOOL_TRACE": f"tests.support.tracing:{callback}",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if path is not None:
        env[FILE_ENV] = str(path)
    return env


def record(event: str, info: dict) -> None:
    """One JSON line per event, at once (the test reads them while the broker runs): its name, its
    plain fields, and the keys of those that are dicts (a request's fields, a reply, a message)."""
    plain = {k: sorted(v) if isinstance(v, dict) else v for k, v in info.items()
             if isinstance(v, (str, int, bool, dict, type(None)))}
    with open(os.environ[FILE_ENV], "a") as f:
        f.write(json.dumps([event, plain]) + "\n")


def fail(event: str, info: dict) -> None:
    raise RuntimeError(f"a diagnostic's own bug, on {event}")


def read(path: Path) -> list[tuple[str, dict]]:
    if not path.exists():
        return []
    return [tuple(json.loads(line)) for line in path.read_text().splitlines()]
