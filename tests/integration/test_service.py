"""Running as a service: sd_notify against a real datagram socket, the watchdog, metrics, the unit."""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

import ipcpool
from tests.support.cli import ipcpool_cmd, on_a_terminal, table_rows

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def notify_socket(tmp_path):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify"))
    sock.settimeout(10)
    yield sock, str(tmp_path / "notify")
    sock.close()


def messages(sock, until: str, limit: float = 10.0) -> list[str]:
    """Datagrams received until one contains ``until``."""
    got = []
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        data = sock.recv(4096).decode()
        got.append(data)
        if until in data:
            return got
    raise AssertionError(f"no {until!r} in {got}")


def test_ready_status_watchdog_and_stopping(start_broker, notify_socket):
    sock, path = notify_socket
    b = start_broker(env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "200000"}, wait=False)
    ready = messages(sock, "READY=1")[-1].splitlines()
    assert "READY=1" in ready and f"MAINPID={b.pid}" in ready
    assert "STATUS=host backend, 0 session(s), 0 object(s)" in ready
    assert (b.socket_dir / "broker.sock").exists()          # READY=1 only once the sockets exist
    t0 = time.monotonic()
    dogs = [m for m in messages(sock, "WATCHDOG=1") if m == "WATCHDOG=1"]
    dogs += [m for m in messages(sock, "WATCHDOG=1") if m == "WATCHDOG=1"]
    assert len(dogs) >= 2 and time.monotonic() - t0 < 1.0   # every 0.1 s (half of WATCHDOG_USEC)
    with ipcpool.connect(b.socket_dir):
        assert any("STATUS=host backend, 1 session(s)" in m for m in messages(sock, "1 session(s)"))
    b.proc.send_signal(signal.SIGTERM)
    assert any("STOPPING=1" in m for m in messages(sock, "STOPPING=1"))
    assert b.proc.wait(10) == 0


def test_a_wedged_loop_stops_feeding_the_watchdog(start_broker, notify_socket):
    sock, path = notify_socket
    b = start_broker(env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "100000"}, wait=False)
    messages(sock, "READY=1")
    os.kill(b.pid, signal.SIGSTOP)                           # a hung broker, as systemd sees it
    try:
        while True:                                          # drain what was sent before the stop
            sock.settimeout(0.3)
            try:
                sock.recv(4096)
            except TimeoutError:
                break
        sock.settimeout(0.5)
        with pytest.raises(TimeoutError):
            sock.recv(4096)
    finally:
        os.kill(b.pid, signal.SIGCONT)
    sock.settimeout(5)
    assert "WATCHDOG=1" in messages(sock, "WATCHDOG=1")[-1]


def test_no_notify_socket_means_no_notifications():
    from ipcpool.broker.systemd import Notifier

    n = Notifier({})
    assert not n.enabled and n.notify("READY=1") is False and n.watchdog_interval is None
    assert Notifier({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"}).watchdog_interval is None
    assert Notifier({"WATCHDOG_USEC": "1000000"}).watchdog_interval == 0.5


def scrape(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        return r.read().decode()


def value(text: str, metric: str) -> float:
    m = re.search(rf"^{re.escape(metric)} (\S+)$", text, re.M)
    assert m, f"{metric} not in metrics"
    return float(m.group(1))


def test_metrics_endpoint(start_broker):
    with socket.socket() as s:   # a free port on loopback
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    b = start_broker(config_text=f'metrics_address = "127.0.0.1:{port}"\n[[pools]]\nname = "default"\nmax_size = "64M"\n')
    with ipcpool.connect(b.socket_dir, arena_bytes=0) as c:   # exact bytes per object
        buf = c.allocate(1 << 20)
        c.create("m/x", 4096).seal()
        with pytest.raises(ipcpool.UnknownPool):
            c.allocate(1, pool="nope")
        time.sleep(1.2)          # gauges refresh about once a second
        c.stats()
        text = scrape(f"127.0.0.1:{port}")
        assert value(text, 'ipcpool_pool_bytes{kind="used",pool="default"}') == (1 << 20) + 4096
        assert value(text, "ipcpool_sessions") == 1
        assert value(text, 'ipcpool_objects{state="sealed"}') == 1
        assert value(text, f'ipcpool_uid_bytes{{uid="{os.getuid()}"}}') == (1 << 20) + 4096
        assert value(text, 'ipcpool_errors_total{kind="UnknownPool"}') == 1
        assert value(text, 'ipcpool_request_seconds_count{op="allocate"}') == 1   # the refused one is an error
        buf.free()


def test_bad_metrics_address_is_refused(tmp_path):
    cfg = tmp_path / "b.toml"
    cfg.write_text('metrics_address = "localhost"\n')
    out = ipcpool_cmd("broker", "--socket-dir", str(tmp_path / "s"), "--config", str(cfg), timeout=30)
    assert out.returncode == 2 and "metrics_address" in out.stderr


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_unit_file_verifies(tmp_path):
    shipped = (ROOT / "deploy/systemd/ipcpool.service").read_text()
    # verify checks that ExecStart's program exists: point it at this interpreter
    unit = re.sub(r"^ExecStart=\S+", f"ExecStart={sys.executable} -m ipcpool", shipped, flags=re.M)
    path = tmp_path / "ipcpool.service"
    path.write_text(unit)
    out = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True, timeout=60)
    problems = [line for line in (out.stdout + out.stderr).splitlines() if "ipcpool.service" in line]
    assert out.returncode == 0 and problems == [], out.stdout + out.stderr
    for key in ("Type=notify", "WatchdogSec=", "Restart=on-failure", "RuntimeDirectory=ipcpool",
                "RuntimeDirectoryMode=0750", "UMask=0007", "DeviceAllow=/dev/nvidia", "User=ipcpool",
                "After=nvidia-persistenced.service", "FileDescriptorStoreMax="):
        assert key in shipped, key
    assert "PrivateDevices=yes" not in shipped and "/tmp" not in shipped


def _unit_here(tmp_path) -> Path:
    """The shipped unit, its ExecStart pointed at this interpreter (the analyzers check it exists)."""
    shipped = (ROOT / "deploy/systemd/ipcpool.service").read_text()
    path = tmp_path / "ipcpool.service"
    path.write_text(re.sub(r"^ExecStart=\S+", f"ExecStart={sys.executable} -m ipcpool", shipped, flags=re.M))
    return path


def _offline_security(path: Path) -> subprocess.CompletedProcess:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    out = subprocess.run(["systemd-analyze", "security", "--offline=yes", "--no-pager", str(path)],
                         capture_output=True, text=True, timeout=60)
    if "--offline" in out.stderr and out.returncode != 0:   # systemd < 250
        pytest.skip("this systemd-analyze cannot analyse a unit file offline")
    return out


def test_unit_hardening_as_systemd_analyze_rates_it(tmp_path):
    out = _offline_security(_unit_here(tmp_path))
    m = re.search(r"Overall exposure level for ipcpool\.service: ([\d.]+) (\w+)", out.stdout)
    assert m, out.stdout + out.stderr
    assert float(m.group(1)) <= 2.0 and m.group(2) == "OK", out.stdout    # it was 6.5 MEDIUM
    passed = {line.split()[1].split("=")[0] + "=" for line in out.stdout.splitlines() if line.startswith("✓")}
    for key in ("SystemCallFilter=", "RestrictSUIDSGID=", "ProtectClock=", "ProtectKernelLogs=", "PrivateTmp=",
                "CapabilityBoundingSet=", "NoNewPrivileges=", "RestrictRealtime=", "ProtectHostname="):
        assert key in passed, f"{key} not satisfied:\n{out.stdout}"
    shipped = (ROOT / "deploy/systemd/ipcpool.service").read_text()
    for kept in ("PrivateDevices=yes", "PrivateUsers=yes", "ProcSubset=pid", "MemoryDenyWriteExecute=yes"):
        assert kept not in shipped, f"{kept} would cut the broker off the GPU or its peers' uids"


def test_unit_documentation_is_installed_by_the_readme():
    shipped = (ROOT / "deploy/systemd/ipcpool.service").read_text()
    doc = re.search(r"^Documentation=file://(\S+)$", shipped, re.M).group(1)
    readme = (ROOT / "README.md").read_text()
    deploy = readme[readme.index("## Deploy with systemd"):]
    assert re.search(rf"^sudo install .*README\.md {re.escape(doc)}\s", deploy, re.M), doc


def test_status_watch_and_trim(start_broker):
    b = start_broker(config_text='[[pools]]\nname = "default"\nmax_size = "64M"\n')
    sd = str(b.socket_dir)
    with ipcpool.connect(sd, arena_bytes=0) as c:   # exact pool accounting
        buf = c.allocate(8 << 20)
        buf.view[:] = b"\x01" * buf.size
        buf.free()
        status = ipcpool_cmd("status", "--socket-dir", sd)
        assert status.returncode == 0 and f"pid {b.pid}" in status.stdout and "backend host" in status.stdout
        rows = table_rows(status.stdout)
        assert rows[2] == ["pool", "used", "reserved", "allocations"]
        assert rows[3] == ["default", "0", "B", "8.0", "MiB", "0"]
        watch = ipcpool_cmd("stats", "--watch", "--count", "3", "--interval", "0.1", "--socket-dir", sd)
        assert watch.returncode == 0 and watch.stdout.count("backend host") == 3
        assert "\x1b" not in watch.stdout                       # a pipe: tables one after another
        code, shown = on_a_terminal("stats", "--watch", "--count", "3", "--interval", "0.1", "--socket-dir", sd)
        assert code == 0 and shown.count("backend host") >= 3 and "\x1b[1A" in shown   # redrawn in place
        keep = ipcpool_cmd("trim", "default", "--keep", "1G", "--socket-dir", sd)   # a size, as in the config
        assert keep.returncode == 0 and "pool default: reserved 8.0 MiB ->" in keep.stdout, keep.stderr
        c.allocate(8 << 20).free()
        trim = ipcpool_cmd("trim", "default", "--socket-dir", sd)
        assert trim.returncode == 0 and "reserved 8.0 MiB -> 0 B" in trim.stdout
        bad = ipcpool_cmd("trim", "default", "--keep", "lots", "--socket-dir", sd)
        assert bad.returncode == 2 and "argument --keep: expected a size such as" in bad.stderr
        assert c.stats()["pools"]["default"]["reserved"] == 0
        bad = ipcpool_cmd("trim", "nope", "--socket-dir", sd)
        assert bad.returncode == 2 and "no pool named 'nope'" in bad.stderr


def test_journald_lines_carry_a_priority(tmp_path):
    out = subprocess.run([sys.executable, "-m", "ipcpool", "broker", "--socket-dir", str(tmp_path / "s"),
                          "--config", str(tmp_path / "missing.toml")],
                         capture_output=True, text=True, timeout=30, env={**os.environ, "JOURNAL_STREAM": "8:1"})
    assert out.returncode == 2 and "cannot read config" in out.stderr
    b = subprocess.Popen([sys.executable, "-m", "ipcpool", "broker", "--socket-dir", str(tmp_path / "s2"),
                          "--backend", "host"], stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "JOURNAL_STREAM": "8:1"})
    with b.stderr:
        first = b.stderr.readline()
        b.send_signal(signal.SIGTERM)
        b.wait(15)
    assert first.startswith("<6>ipcpool.broker.server: broker ready"), first


def test_a_full_notify_queue_never_blocks_the_broker(tmp_path):
    from ipcpool.broker.systemd import Notifier

    deaf = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)   # a service manager that never reads
    deaf.bind(str(tmp_path / "deaf"))
    try:
        n = Notifier({"NOTIFY_SOCKET": str(tmp_path / "deaf")})
        t0 = time.monotonic()
        for i in range(200):
            n.status(f"line {i}")
        assert time.monotonic() - t0 < 2.0
        assert n.notify("STATUS=one more") is False        # dropped, not waited for
        n.close()
    finally:
        deaf.close()


def test_a_busy_metrics_port_is_a_clear_error(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        cfg = tmp_path / "b.toml"
        cfg.write_text(f'metrics_address = "127.0.0.1:{port}"\n')
        out = ipcpool_cmd("broker", "--socket-dir", str(tmp_path / "s"), "--config", str(cfg), timeout=30)
    assert out.returncode == 2 and f"metrics_address 127.0.0.1:{port}: cannot listen" in out.stderr
    assert "Traceback" not in out.stderr
