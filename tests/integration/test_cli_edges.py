"""The `ipcpool` command's edges: exit codes, --json errors, a closed pipe, 80 columns, sessions,
rm --prefix, doctor's broker line, the config template and the packaging around it."""

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import ipcpool
from ipcpool.config import parse

ROOT = Path(__file__).resolve().parents[2]
_SCRIPT = Path(sys.executable).parent / "ipcpool"
IPCPOOL = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "ipcpool"]


def cli(*args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*IPCPOOL, *args], capture_output=True, text=True, timeout=60, **kw)


def test_errors_exit_2_and_with_json_are_json_on_stdout(tmp_path):
    out = cli("status", "--socket-dir", str(tmp_path))
    assert out.returncode == 2 and out.stderr.startswith("ipcpool status: no broker is serving") and not out.stdout
    for command in ("status", "stats", "ls", "sessions"):
        out = cli(command, "--json", "--socket-dir", str(tmp_path))
        assert out.returncode == 2 and out.stderr == "", out.stderr
        err = json.loads(out.stdout)
        assert err["type"] == "BrokerGone" and err["code"] == 3 and "start one with `ipcpool broker`" in err["error"]


def test_a_closed_pipe_exits_quietly(tmp_path):
    r, w = os.pipe()
    os.close(r)   # the reader is gone before anything is written (`| head` that has had enough)
    proc = subprocess.run([*IPCPOOL, "broker", "--print-config"], stdout=w, stderr=subprocess.PIPE, text=True,
                          timeout=60)
    os.close(w)
    assert proc.returncode == 141 and proc.stderr == "", proc.stderr


def test_status_json_says_what_runs_and_stats_json_every_figure(broker):
    sd = str(broker.socket_dir)
    status, stats = json.loads(cli("status", "--json", "--socket-dir", sd).stdout), json.loads(
        cli("stats", "--json", "--socket-dir", sd).stdout)
    assert status["socket_dir"] == sd and status["pid"] == broker.pid and status["version"] == ipcpool.__version__
    assert set(status["pools"]["default"]) == {"used", "reserved", "allocations"}
    assert {"reserved_high", "used_high", "arena_free", "growable_bytes"} <= set(stats["pools"]["default"])


def test_stats_fits_80_columns(broker):
    with ipcpool.connect(broker.socket_dir) as c, c.allocate(3 << 20):
        out = cli("stats", "--socket-dir", str(broker.socket_dir))
    lines = out.stdout.splitlines()
    assert out.returncode == 0 and "default" in out.stdout and "3.0 MiB" in out.stdout, out.stdout
    assert max(map(len, lines)) <= 80, "\n".join(lines)


def test_sessions_shows_the_process_behind_each_session(broker):
    sd = str(broker.socket_dir)
    with ipcpool.connect(sd, arena_bytes=0) as writer, ipcpool.connect(sd, arena_bytes=0) as reader:
        held = writer.allocate(2 << 20)
        with writer.create("s/x", 1 << 20) as buf:
            buf.seal()
        lease = reader.get("s/x")
        rows = {r["session"]: r for r in json.loads(cli("sessions", "--json", "--socket-dir", sd).stdout)}
        w, r = rows[writer.session], rows[reader.session]
        assert w["pid"] == r["pid"] == os.getpid() and w["uid"] == os.getuid() and w["user"] == "root"
        assert w["bytes"] == 2 << 20 and w["allocations"] == 1 and w["leases"] == 0 and w["state"] == "open"
        assert r["bytes"] == 1 << 20 and r["leases"] == 1
        assert sum(row["self"] for row in rows.values()) == 1   # the command's own session, marked
        table = cli("sessions", "--socket-dir", sd).stdout
        assert f"{writer.session}  " in table and str(os.getpid()) in table and "2.0 MiB" in table, table
        lease.free()
        held.free()


def test_rm_prefix_and_exit_1_for_what_is_not_there(broker):
    sd = str(broker.socket_dir)
    with ipcpool.connect(sd) as c:
        for name in ("a/1", "a/2", "b/1"):
            with c.create(name, 4096) as buf:
                buf.seal()
        c.create_growable("a/g", 1 << 20).close()
        out = cli("rm", "--prefix", "a/", "--socket-dir", sd)
        assert out.returncode == 0 and out.stdout.strip() == "removed 3 name(s) under a/", out.stdout + out.stderr
        assert [o["name"] for o in c.list()] == ["b/1"] and c.list_growables() == []
    again = cli("rm", "--prefix", "a/", "--socket-dir", sd)
    assert again.returncode == 1 and again.stderr.strip() == "ipcpool rm: nothing is named a/...", again.stderr
    missing = cli("rm", "nope/x", "--socket-dir", sd)
    assert missing.returncode == 1 and "no object, growable buffer or checkpoint named 'nope/x'" in missing.stderr


def test_doctor_says_whether_a_broker_answers(broker, tmp_path):
    rep = json.loads(cli("doctor", "--json", "--socket-dir", str(broker.socket_dir)).stdout)["broker"]
    assert rep["answers"] is True and rep["pid"] == broker.pid and rep["backend"] == "host"
    none = cli("doctor", "--socket-dir", str(tmp_path))
    assert f"broker: none answers at {tmp_path} (no broker is serving" in none.stdout, none.stdout


def test_the_config_template_comes_with_the_package():
    out = cli("broker", "--print-config")
    shipped = (ROOT / "ipcpool" / "config_template.toml").read_text()
    assert out.returncode == 0 and out.stdout == shipped
    assert (ROOT / "deploy" / "broker.toml").read_text() == shipped   # deploy/ links to it
    parse(tomllib.loads(out.stdout))                                  # and it is a valid config
    assert "--print-config" in cli("broker", "--help").stdout


def test_packaging_metadata_license_types_and_one_version():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and project["project"]["dynamic"] == ["version"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "ipcpool._version.__version__"}
    data = project["tool"]["setuptools"]["package-data"]["ipcpool"]
    assert {"py.typed", "config_template.toml"} <= set(data)
    assert all((ROOT / "ipcpool" / f).is_file() for f in data)
    assert (ROOT / "LICENSE").is_file() and project["project"]["license"] == "MIT"
    from importlib.metadata import version
    assert version("ipcpool") == ipcpool.__version__ == cli("--version").stdout.split()[1]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_bench_writes_outside_the_tracked_results(tmp_path):
    shutil.copy(ROOT / "Makefile", tmp_path)
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    venv = tmp_path / ".venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").write_text(f'#!/bin/sh\necho "$*" > {tmp_path}/args\n')
    (venv / "python").chmod(0o755)
    (tmp_path / ".venv" / ".installed").touch()   # set up already
    out = subprocess.run(["make", "--no-print-directory", "bench"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    args = (tmp_path / "args").read_text().split()
    assert args[0] == "bench/host_roundtrip.py" and args[args.index("--out-dir") + 1] == "bench/out"
    ignored = subprocess.run(["git", "check-ignore", "-q", "bench/out/host_roundtrip.json"], cwd=ROOT)
    assert ignored.returncode == 0 or not (ROOT / ".git").exists()
    assert "--out-dir" in subprocess.run([sys.executable, str(ROOT / "bench/host_roundtrip.py"), "--help"],
                                         capture_output=True, text=True, cwd=ROOT, timeout=60).stdout
