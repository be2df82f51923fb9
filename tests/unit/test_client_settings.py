"""The client's settings from the environment: defaults, values, and a clear error for bad ones."""

from __future__ import annotations

import pytest

from ipcpool._client.settings import Settings


def test_defaults_where_nothing_is_set(monkeypatch):
    for name in ("IPCPOOL_CLIENT_SPIN_US", "IPCPOOL_ARENA_BYTES", "IPCPOOL_GET_SPIN_US", "IPCPOOL_GROWABLE_SPAN"):
        monkeypatch.delenv(name, raising=False)
    s = Settings.from_env(None)
    assert (s.spin_s, s.arena_bytes, s.get_spin_s, s.growable_span) == (300e-6, 32 << 20, 1000e-6, None)


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
