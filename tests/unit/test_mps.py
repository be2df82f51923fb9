"""CUDA MPS: `ipcpool doctor` and the broker's start-up log say when MPS serves the device and what it
means for crash isolation; the GPU tests that kill CUDA processes carry a marker the MPS run leaves
out. MPS itself is faked here: a pipe directory holding a ``control`` socket, as its daemon makes."""

from __future__ import annotations

import logging
import socket
import importlib.util
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from ipcpool.cli import doctor
from ipcpool.backend import Choice
from ipcpool.backend.host import HostBrokerBackend
from ipcpool.backend.mps import mps_warnings
from ipcpool.broker import server
from ipcpool.config import Config

ROOT = Path(__file__).resolve().parents[2]
KILL_TESTS = {
    "test_killed_client_memory_comes_back",
    "test_readers_never_see_a_mix_on_the_gpu",
    "test_client_killed_with_a_free_in_flight",
    "test_writer_death_on_a_gpu",
    "test_a_pending_reader_of_a_writer_killed_before_its_seal_gets_object_aborted",
    "test_objects_and_growables_survive_two_broker_crashes",
    "test_a_killed_borrowers_loan_is_released_and_the_stock_made_again",
}


@pytest.fixture
def mps_pipe(tmp_path, monkeypatch):
    """A pipe directory whose ``control`` is a listening AF_UNIX socket, named by
    CUDA_MPS_PIPE_DIRECTORY as for the MPS daemon's clients."""
    pipe = tmp_path / "mps-pipe"
    pipe.mkdir()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(pipe / "control"))
    sock.listen(1)
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(pipe))
    yield pipe
    sock.close()


def _says_what_mps_means(text: str) -> None:
    for words in ("killed with GPU work in flight", "every process on the GPU", "failed state",
                  "memory", "bookkeeping", "MPS server restarted"):
        assert words in text, (words, text)


def test_doctor_gives_the_crash_isolation_note_when_mps_serves_the_device(mps_pipe):
    mps = doctor.mps_status(cuda_usable=True)
    assert mps["pipe_directory"] == str(mps_pipe) and mps["control_socket"] is True
    assert mps["serves_device"] is True and mps["crash_isolation"] == "shared"
    _says_what_mps_means(mps["note"])


def test_no_note_without_mps_or_without_a_gpu(tmp_path, monkeypatch, mps_pipe):
    no_gpu = doctor.mps_status(cuda_usable=False)   # a control socket, but no device to serve
    assert no_gpu["serves_device"] is False and no_gpu["crash_isolation"] == "per-process"
    assert no_gpu["note"] is None
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path / "empty"))
    off = doctor.mps_status(cuda_usable=True)
    assert off["control_socket"] is False and off["serves_device"] is False
    assert off["crash_isolation"] == "per-process" and off["note"] is None


def test_doctor_report_and_text_carry_the_note(mps_pipe, monkeypatch):
    """The whole report (what `--json` prints, old keys kept) and its text lines, on a machine
    whose CUDA answers (faked: the report then says it could not read the capabilities)."""
    monkeypatch.setattr(doctor.backends, "probe_cuda", lambda: (True, "driver faked by the test"))
    rep, _ = doctor.report("host")
    assert set(rep["mps"]) >= {"pipe_directory", "control_socket", "control_daemon_pids", "server_pids",
                               "serves_device", "crash_isolation", "note"}
    assert rep["mps"]["serves_device"] is True
    _says_what_mps_means(rep["mps"]["note"])
    text = "\n".join(doctor.lines(rep))
    assert f"MPS: serves the device (control socket in {mps_pipe})" in text
    assert "crash isolation: shared" in text
    _says_what_mps_means(text)


class _FakeCudaBackend(HostBrokerBackend):
    """Host memory (this machine may have no GPU) with the CUDA backend's start-up warnings."""

    def startup_warnings(self) -> list[str]:
        return mps_warnings()


def _start(monkeypatch, tmp_path, name: str) -> server.Broker:
    """A broker whose choice says `name`, serving host memory (this machine may have no GPU)."""
    backend = _FakeCudaBackend if name == "cuda" else HostBrokerBackend
    monkeypatch.setattr(server, "broker_backend", lambda _: backend())
    b = server.Broker(Config(), Choice(name, "faked by the test"), tmp_path / "sock")
    b.start()
    return b


@pytest.mark.parametrize("backend", ["cuda", "host"])
def test_the_broker_warns_at_start_when_mps_serves_its_device(backend, mps_pipe, monkeypatch, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="ipcpool")
    b = _start(monkeypatch, tmp_path, backend)
    b.close()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "MPS" in r.getMessage()]
    if backend == "host":   # host memory: MPS is no concern of the broker's
        assert warnings == []
        return
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    msg = warnings[0].getMessage()
    assert str(mps_pipe) in msg and "ipcpool doctor" in msg and "\n" not in msg
    _says_what_mps_means(msg)


def test_no_mps_warning_from_a_cuda_broker_without_mps(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path / "no-mps"))
    caplog.set_level(logging.INFO, logger="ipcpool")
    _start(monkeypatch, tmp_path, "cuda").close()
    assert any("broker ready" in r.getMessage() for r in caplog.records)
    assert not any("MPS" in r.getMessage() for r in caplog.records)


def test_the_kills_clients_marker_is_registered():
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert "--strict-markers" in conf["addopts"]
    assert any(m.split(":")[0].strip() == "kills_clients" for m in conf["markers"])


def _collected(expr: str) -> set[str]:
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "-m", expr, "tests/gpu"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode in (0, 5), out.stdout + out.stderr   # 5: nothing selected
    return {line.split("::")[-1].split("[")[0] for line in out.stdout.splitlines() if "::" in line}


def test_the_mps_run_leaves_out_exactly_the_tests_that_kill_cuda_processes():
    """What scripts/gpu_suite.sh mps runs (`-m "gpu and not kills_clients"`) holds no test that
    SIGKILLs a CUDA process, and still holds the rest of the GPU suite."""
    expected = set(KILL_TESTS)
    if importlib.util.find_spec("torch") is None:   # (its module is skipped whole without torch)
        expected.discard("test_readers_never_see_a_mix_on_the_gpu")
    assert _collected("kills_clients") == expected
    under_mps = _collected("gpu and not kills_clients")
    assert not under_mps & KILL_TESTS
    assert {"test_32_concurrent_clients", "test_garbage_on_one_pools_board_stays_there"} <= under_mps
