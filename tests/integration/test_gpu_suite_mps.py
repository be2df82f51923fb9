"""scripts/gpu_suite.sh mps, on a machine without a GPU: it says so and fails where the MPS control
program is missing, and where MPS does not serve a device it fails before any test and still stops
the daemon it started. The control program is a stub that records what it was asked."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ipcpool.backend import probe_cuda

ROOT = Path(__file__).resolve().parents[2]
SUITE = ROOT / "scripts/gpu_suite.sh"

STUB = r"""#!/usr/bin/env bash
# nvidia-cuda-mps-control, as far as gpu_suite.sh uses it: -d starts a "daemon" (a sleep) with its
# control socket and pid file; commands come on stdin.
if [ "${1:-}" = -d ]; then
  echo "start pipe=$CUDA_MPS_PIPE_DIRECTORY log=$CUDA_MPS_LOG_DIRECTORY" >> "$STUB_RECORD"
  python3 -c "import socket, sys; socket.socket(socket.AF_UNIX).bind(sys.argv[1])" "$CUDA_MPS_PIPE_DIRECTORY/control"
  sleep 300 </dev/null >/dev/null 2>&1 &
  echo $! > "$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid"
  echo "daemon $!" >> "$STUB_RECORD"
  exit 0
fi
cmd=$(cat)
echo "cmd $cmd" >> "$STUB_RECORD"
[ "$cmd" = quit ] && kill "$(cat "$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid")"
exit 0
"""


def _env(tmp_path, with_stub: bool) -> dict[str, str]:
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    if with_stub:
        stub = bindir / "nvidia-cuda-mps-control"
        stub.write_text(STUB)
        stub.chmod(0o755)
    path = [str(bindir), str(Path(sys.executable).parent), "/usr/bin", "/bin"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_MPS_", "PYTEST_"))}
    env.update(PATH=os.pathsep.join(path), STUB_RECORD=str(tmp_path / "record"), OUT=str(tmp_path / "out"))
    return env


def _suite(tmp_path, env):
    return subprocess.run(["bash", str(SUITE), "--wheels", str(tmp_path / "no-wheels"), "--keep-files", "mps"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_mps_mode_without_the_mps_control_program_says_so(tmp_path):
    env = _env(tmp_path, with_stub=False)
    if shutil.which("nvidia-cuda-mps-control", path=env["PATH"]):
        pytest.skip("this machine has nvidia-cuda-mps-control")
    out = _suite(tmp_path, env)
    assert out.returncode == 1
    assert "mode mps needs nvidia-cuda-mps-control" in out.stderr
    assert not (tmp_path / "out").exists()   # it stopped before doing anything


@pytest.mark.skipif(probe_cuda()[0], reason="this machine has a GPU: MPS would serve it")
def test_mps_mode_where_mps_serves_no_device_fails_before_the_tests_and_stops_the_daemon(tmp_path):
    env = _env(tmp_path, with_stub=True)
    out = _suite(tmp_path, env)
    record = (tmp_path / "record").read_text()
    daemon = int(re.search(r"^daemon (\d+)$", record, re.M).group(1))
    try:
        assert out.returncode == 1, out.stdout + out.stderr
        assert "MPS does not serve the device" in out.stderr
        assert "ipcpool doctor: serves_device=False" in out.stdout
        assert "test session starts" not in out.stdout   # no test ran outside MPS
        pipe, log = re.search(r"^start pipe=(\S+) log=(\S+)$", record, re.M).groups()
        assert pipe != log and Path(pipe).name.startswith("ipcpool-mps-pipe.")
        assert record.splitlines()[-1] == "cmd quit"         # stopped on the way out
        assert not Path(pipe).exists() and not Path(log).exists()
        assert "MPS control daemon stopped" in out.stdout
        with pytest.raises(ProcessLookupError):
            os.kill(daemon, 0)
    finally:
        try:
            os.kill(daemon, 9)
        except ProcessLookupError:
            pass
