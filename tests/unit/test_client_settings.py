"""The client's settings from the environment: defaults, values, and a clear error for bad ones."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ipcpool import cpus
from ipcpool._client.settings import Settings


def test_defaults_where_nothing_is_set(monkeypatch):
    for name in ("IPCPOOL_CLIENT_SPIN_US", "IPCPOOL_ARENA_BYTES", "IPCPOOL_GET_SPIN_US", "IPCPOOL_GROWABLE_SPAN"):
        monkeypatch.delenv(name, raising=False)
    s = Settings.from_env(None)
    spins = cpus.usable() >= cpus.SPIN_MIN_CPUS
    assert (s.spin_s, s.arena_bytes, s.get_spin_s, s.growable_span) == (
        300e-6 if spins else 0.0, 32 << 20, 1000e-6 if spins else 0.0, None)


def test_on_fewer_than_four_cpus_neither_a_client_nor_the_broker_spins_by_default():
    """A process held to one CPU (its affinity, as a cgroup or taskset would set it)."""
    code = ("import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
            "from ipcpool._client.settings import Settings; from ipcpool.config import parse; "
            "s = Settings.from_env(None); print(s.spin_s, s.get_spin_s, parse({}).busy_poll_us, parse({}).busy_poll_parked_us)")
    env = {k: v for k, v in os.environ.items() if k not in ("IPCPOOL_CLIENT_SPIN_US", "IPCPOOL_GET_SPIN_US")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0.0", "0.0", "0", "0"]
    assert cpus.spin_default(500, cpus=4) == 500 and cpus.spin_default(500, cpus=3) == 0


def test_values_from_the_environment(monkeypatch):
    monkeypatch.setenv("IPCPOOL_CLIENT_SPIN_US", "0")
    monkeypatch.setenv("IPCPOOL_GROWABLE_SPAN", "0")
    monkeypatch.setenv("IPCPOOL_ARENA_BYTES", "1048576")
    s = Settings.from_env(None)
    assert (s.spin_s, s.get_spin_s, s.growable_span, s.arena_bytes) == (0.0, 0.0, 0, 1 << 20)
    monkeypatch.setenv("IPCPOOL_GROWABLE_SPAN", " 17179869184 ")
    assert Settings.from_env(4096).growable_span == 16 << 30
    assert Settings.from_env(4096).arena_bytes == 4096   # connect's argument wins


@pytest.mark.parametrize("raw", ["abc", "-1", "1.5", "1G"])
def test_a_bad_value_names_the_variable(monkeypatch, raw):
    monkeypatch.setenv("IPCPOOL_GROWABLE_SPAN", raw)
    with pytest.raises(ValueError, match=r"IPCPOOL_GROWABLE_SPAN must be a non-negative integer, got"):
        Settings.from_env(None)
