"""The `ipcpool` command as an operator runs it."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import ipcpool


def ipcpool_cmd(*args, timeout=120, env=None):
    return subprocess.run([sys.executable, "-m", "ipcpool", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


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
        c.allocate(10)
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
    with ipcpool.connect(broker.socket_dir) as c, c.allocate(1 << 20):
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
