"""The fixtures themselves: a broker that crashes during a test fails that test."""

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_inner(tmp_path, body: str) -> subprocess.CompletedProcess:
    (tmp_path / "conftest.py").write_text("from tests.conftest import broker, start_broker  # noqa: F401\n")
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(body))
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
         str(tmp_path / "test_inner.py")],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(ROOT),
                                                                    "PATH": "/usr/bin:/bin"},
    )


def test_a_broker_that_crashes_during_a_test_fails_it(tmp_path):
    out = run_inner(tmp_path, """
        import os, signal

        def test_crashes_the_broker(broker):
            os.kill(broker.pid, signal.SIGABRT)       # what libzmq's abort does
            broker.proc.wait(15)

        def test_staged_kill_is_fine(start_broker):
            b = start_broker()
            assert b.kill() == -signal.SIGKILL

        def test_clean_stop_is_fine(broker):
            pass
    """)
    summary = out.stdout.strip().splitlines()[-1]
    assert "3 passed" in summary and "1 error" in summary, out.stdout + out.stderr
    assert "ERROR at teardown of test_crashes_the_broker" in out.stdout
    assert f"exited by itself with status -{6}" in out.stdout
