"""The `ipcpool` command as an operator runs it."""

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ipcpool


from tests.support.cli import IPCPOOL, ipcpool_cmd


def test_second_broker_on_the_same_dir_is_refused(broker):
    out = ipcpool_cmd("broker", "--socket-dir", str(broker.socket_dir), "--backend", "host", timeout=30)
    assert out.returncode == 2
    assert f"another broker (pid {broker.pid}) already serves {broker.socket_dir}" in out.stderr
    with ipcpool.connect(broker.socket_dir) as c:       # the first one is untouched
        assert c.stats()["pid"] == broker.pid


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_clean_exit_on_signal_with_clients_connected(start_broker, sig):
    b = start_broker()
    c = ipcpool.connect(b.socket_dir)
    c.allocate(1000)
    b.proc.send_signal(sig)
    assert b.proc.wait(15) == 0
    assert "broker stopping (1 sessions)" in b.log()
    assert not (b.socket_dir / "broker.sock").exists() and not (b.socket_dir / "broker.zmq").exists()
    with pytest.raises(ipcpool.BrokerGone, match="went away"):
        c.stats()   # (not a small allocate: that is carved here and needs no answer)
    c.close()    # closing after the broker died is quiet
    with pytest.raises(ipcpool.BrokerGone, match="no broker is serving"):
        ipcpool.connect(b.socket_dir)


def test_restart_after_crash_takes_over_stale_sockets(start_broker):
    b = start_broker()
    b.kill()
    assert (b.socket_dir / "broker.sock").exists()     # left behind by the crash
    b2 = start_broker(socket_dir=b.socket_dir)
    with ipcpool.connect(b2.socket_dir) as c:
        assert c.stats()["pid"] == b2.pid


def test_stats_table_and_json(broker):
    with ipcpool.connect(broker.socket_dir, arena_bytes=0) as c, c.allocate(1 << 20):
        out = ipcpool_cmd("stats", "--socket-dir", str(broker.socket_dir), "--json")
        assert out.returncode == 0, out.stderr
        stats = json.loads(out.stdout)
        assert stats["backend"] == "host" and stats["sessions"] == 2
        assert stats["pools"]["default"]["used"] == 1 << 20
        table = ipcpool_cmd("stats", "--socket-dir", str(broker.socket_dir))
        assert "default" in table.stdout and "1.0 MiB" in table.stdout


def test_stats_uses_the_environment_variable(broker):
    env = {**os.environ, "IPCPOOL_SOCKET_DIR": str(broker.socket_dir)}
    out = ipcpool_cmd("stats", "--json", env=env)
    assert json.loads(out.stdout)["pid"] == broker.pid


def test_stats_without_a_broker_says_what_to_do(tmp_path):
    out = ipcpool_cmd("stats", "--socket-dir", str(tmp_path))
    assert out.returncode == 2 and "start one with `ipcpool broker`" in out.stderr


def test_demo(broker):
    out = ipcpool_cmd("demo", "--socket-dir", str(broker.socket_dir))
    assert out.returncode == 0, out.stderr
    assert "verified every byte: OK" in out.stdout and "host backend" in out.stdout


def test_demo_without_a_broker_runs_a_private_one_and_stops_it(tmp_path):
    t0 = time.monotonic()
    out = ipcpool_cmd("demo", "--socket-dir", str(tmp_path / "nobody"), timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == f"no broker serves {tmp_path / 'nobody'}: the demo starts a private one for itself"
    assert lines[1].startswith("private broker pid ") and "ready (host backend" in lines[1]
    assert "verified every byte: OK" in out.stdout and lines[-1] == "private broker stopped"
    pid = int(lines[1].split()[3])
    assert not Path(f"/proc/{pid}").exists()                  # stopped, and reaped
    private_dir = Path(lines[1].rsplit(", ", 1)[1].rstrip(")"))
    assert not private_dir.exists()                           # and its directory removed
    assert out.stderr == "" and time.monotonic() - t0 < 30


def test_demo_private_uses_its_own_broker_even_where_one_runs(broker):
    out = ipcpool_cmd("demo", "--private", "--socket-dir", str(broker.socket_dir), timeout=60)
    assert out.returncode == 0 and "private broker pid" in out.stdout and "OK" in out.stdout, out.stderr
    with ipcpool.connect(broker.socket_dir) as c:   # the running broker saw none of it
        assert c.stats()["pools"]["default"]["used_high"] == 0


def test_demo_failure_is_one_line_and_quick(start_broker):
    b = start_broker(config_text='[[pools]]\nname = "default"\nmax_size = "1M"\n')   # too small for 4 MiB
    t0 = time.monotonic()
    out = ipcpool_cmd("demo", "--socket-dir", str(b.socket_dir), timeout=60)
    assert out.returncode == 2 and time.monotonic() - t0 < 15
    assert out.stderr.splitlines() == [out.stderr.strip()] and "Traceback" not in out.stderr
    assert out.stderr.startswith("ipcpool demo: producer: no free block of 4194304 bytes")


@pytest.mark.skipif(ipcpool.backend.probe_cuda()[0], reason="this machine has a GPU")
def test_demo_whose_private_broker_cannot_start_says_why(tmp_path):
    t0 = time.monotonic()
    out = ipcpool_cmd("demo", "--backend", "cuda", "--socket-dir", str(tmp_path / "none"), timeout=60)
    assert out.returncode == 2 and time.monotonic() - t0 < 15
    assert out.stderr.strip().startswith("ipcpool demo: the private broker did not start: ")
    assert "use --backend host" in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_doctor_json_is_always_json():
    ok, why = ipcpool.backend.probe_cuda()
    out = ipcpool_cmd("doctor", "--json")
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert rep["backend"] == ("cuda" if ok else "host") and why in rep["reason"]
    assert rep["cuda"] == {"usable": ok, "why": why}
    assert (rep["capabilities"] is not None) == ok and isinstance(rep["mps"]["serves_device"], bool)
    if ok:
        assert rep["capabilities"]["device_count"] >= 1
    else:
        assert rep["mps"]["serves_device"] is False
    forced = json.loads(ipcpool_cmd("doctor", "--json", "--backend", "host").stdout)
    assert forced["backend"] == "host" and forced["reason"] == "asked for host memory"
    if not ok:   # a backend that cannot run here: still JSON, with the error, and exit 1
        cuda = ipcpool_cmd("doctor", "--json", "--backend", "cuda")
        assert cuda.returncode == 1 and json.loads(cuda.stdout)["backend"] is None
        assert "use --backend host" in json.loads(cuda.stdout)["error"]


def test_doctor_sees_an_mps_control_socket(tmp_path):
    (tmp_path / "control").touch()
    out = ipcpool_cmd("doctor", "--json", env={**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)})
    mps = json.loads(out.stdout)["mps"]
    assert mps["pipe_directory"] == str(tmp_path) and mps["control_socket"] is True
    assert mps["serves_device"] is ipcpool.backend.probe_cuda()[0]


def test_version():
    out = ipcpool_cmd("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"ipcpool {ipcpool.__version__}"


def test_log_level_after_the_command(tmp_path):
    """As the unit's ExecStart may end: `ipcpool broker ... --log-level LEVEL` (any case)."""
    args = [*IPCPOOL, "broker", "--socket-dir", str(tmp_path / "s"), "--backend", "host"]
    for level, shows_info in (("warning", False), ("debug", True)):
        b = subprocess.Popen([*args, "--log-level", level], stderr=subprocess.PIPE, text=True)
        try:
            _wait_for_broker(tmp_path / "s")
        finally:
            b.send_signal(signal.SIGTERM)
            _, err = b.communicate(timeout=15)
        assert b.returncode == 0, err
        assert ("broker ready" in err) is shows_info, err
    bad = ipcpool_cmd("broker", "--socket-dir", str(tmp_path / "s"), "--log-level", "loud")
    assert bad.returncode == 2 and "argument --log-level: one of DEBUG, INFO, WARNING, ERROR" in bad.stderr


def _wait_for_broker(socket_dir: Path, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with ipcpool.connect(socket_dir, timeout=5) as c:
                c.stats()
                return
        except ipcpool.BrokerGone:
            assert time.monotonic() < deadline, f"no broker at {socket_dir}"
            time.sleep(0.05)


def _commands() -> dict:
    from ipcpool.cli.main import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {"": parser, **sub.choices}


@pytest.mark.parametrize("command", sorted(_commands()))
def test_help_explains_every_option(command):
    parser = _commands()[command]
    out = ipcpool_cmd(*([command] if command else []), "--help")
    assert out.returncode == 0 and out.stdout.startswith("usage: ipcpool"), out.stderr
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            continue
        assert action.help, f"ipcpool {command}: {action.option_strings or action.dest} has no help"
        name = action.option_strings[-1] if action.option_strings else (action.metavar or action.dest)
        assert name in out.stdout, name
        assert " ".join(action.help.split()[:3]) in " ".join(out.stdout.split()), action.help


def test_load_of_a_missing_file_is_one_line(tmp_path):
    out = ipcpool_cmd("load", str(tmp_path / "nope.safetensors"), "--socket-dir", str(tmp_path))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr == f"ipcpool load: {tmp_path / 'nope.safetensors'}: No such file or directory\n"


def test_a_pools_table_instead_of_an_array_points_to_double_brackets(tmp_path):
    cfg = tmp_path / "b.toml"
    cfg.write_text('[pools.default]\nmax_size = "1G"\n')
    out = ipcpool_cmd("broker", "--socket-dir", str(tmp_path / "s"), "--config", str(cfg), timeout=30)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert 'write [[pools]] then name = "default" instead of [pools.default]' in out.stderr


def test_doctor_explains_the_choice():
    out = ipcpool_cmd("doctor")
    assert out.returncode == 0
    ok, why = ipcpool.backend.probe_cuda()
    assert f"backend chosen: {'cuda' if ok else 'host'}" in out.stdout and why in out.stdout
    forced = ipcpool_cmd("doctor", "--backend", "host")
    assert "backend chosen: host (asked for host memory)" in forced.stdout


def test_bad_config_is_refused_at_start(tmp_path):
    cfg = tmp_path / "b.toml"
    cfg.write_text('[[pools]]\nname = "x"\nmax_size = "huge"\n')
    out = ipcpool_cmd("broker", "--socket-dir", str(tmp_path / "s"), "--config", str(cfg), timeout=30)
    assert out.returncode == 2 and "pools[0].max_size" in out.stderr


@pytest.mark.skipif(ipcpool.backend.probe_cuda()[0], reason="this machine has a GPU")
def test_cuda_backend_without_gpu_is_a_clear_error(tmp_path):
    out = ipcpool_cmd("broker", "--socket-dir", str(tmp_path / "s"), "--backend", "cuda", timeout=30)
    assert out.returncode == 2 and "use --backend host" in out.stderr


def test_startup_time_of_a_host_worker(broker):
    code = ("import time; t = time.perf_counter(); import ipcpool, sys; "
            "c = ipcpool.connect(sys.argv[1]); b = c.allocate(10); b.free(); c.close(); "
            "print(time.perf_counter() - t)")
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code, str(broker.socket_dir)], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    assert out.returncode == 0, out.stderr
    assert float(out.stdout) < 0.5 and wall < 1.0, (out.stdout, wall)
