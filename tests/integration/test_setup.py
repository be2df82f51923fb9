"""The README's set-up: `make run` and `make test` side by side from a fresh clone.

The Makefile runs as written, with a stand-in for the interpreter (PYTHON=...) that records what
it is asked to do and takes its time installing, so overlapping installs would show."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("make") is None or shutil.which("flock") is None,
                                reason="needs make and flock")

FAKE_PYTHON = """\
#!/bin/sh
# `python3 -m venv [--clear] DIR`: a venv whose python is the stand-in below.
log={log}
[ "$1 $2" = "-m venv" ] || exit 3
shift 2; [ "$1" = --clear ] && shift
echo "venv $1" >> $log
mkdir -p "$1/bin"
cat > "$1/bin/python" <<'PY'
{venv_python}
PY
chmod +x "$1/bin/python"
"""

VENV_PYTHON = """\
#!/bin/sh
log={log}
bin=$(dirname "$0")
case "$*" in
  "-m pip --version") [ -f "$bin/pip-ok" ] || exit 1 ;;
  "-m pip install"*)
    mkdir {busy} 2>/dev/null || echo OVERLAP >> $log
    echo "pip $*" >> $log
    sleep 1
    rmdir {busy}
    touch "$bin/pip-ok"
    printf '#!/bin/sh\\necho "ipcpool $*"\\n' > "$bin/ipcpool"; chmod +x "$bin/ipcpool" ;;
  "-m pytest"*) echo "pytest ran" ;;
  *) exit 4 ;;
esac
"""


@pytest.fixture
def clone(tmp_path):
    for name in ("Makefile", "pyproject.toml", "ipcpool/shm/_native.c"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    log, busy = tmp_path / "calls.log", tmp_path / "busy"
    fake = tmp_path / "fake-python3"
    venv_python = VENV_PYTHON.format(log=log, busy=busy)
    fake.write_text(FAKE_PYTHON.format(log=log, venv_python=venv_python.rstrip("\n")))
    fake.chmod(0o755)
    return tmp_path, f"PYTHON={fake}", log


def make(cwd, *args):
    return subprocess.Popen(["make", "--no-print-directory", *args], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_run_and_test_side_by_side_install_once(clone):
    root, python, log = clone
    run, test = make(root, "run", python, "ARGS=--backend host"), make(root, "test", python)
    run_out, _ = run.communicate(timeout=60)
    test_out, _ = test.communicate(timeout=60)
    assert run.returncode == 0 and test.returncode == 0, run_out + test_out
    assert "ipcpool broker --backend host" in run_out and "pytest ran" in test_out
    calls = log.read_text().splitlines()
    assert "OVERLAP" not in calls
    assert [c.split()[0] for c in calls] == ["venv", "pip", "pip", "pip"]   # one venv, one install
    assert calls[2].endswith("install --quiet -e .[test,bench]")
    assert calls[3].endswith("install --quiet --no-deps nixl-cu13==1.5.1")   # without its torch

    again = make(root, "test", python)                                  # set up already: nothing to do
    again.communicate(timeout=30)
    assert again.returncode == 0 and log.read_text().splitlines() == calls


def test_a_changed_c_part_is_installed_again(clone):
    """The install builds ipcpool/shm/_native.c: a newer one makes `make test` install again (a
    stale build would be tested instead), and only once."""
    root, python, log = clone
    first = make(root, "test", python)
    first.communicate(timeout=60)
    installs = [c for c in log.read_text().splitlines() if c.endswith("-e .[test,bench]")]
    edited = (root / "ipcpool/shm/_native.c").stat().st_mtime   # pyproject.toml, the install, then the C
    os.utime(root / "pyproject.toml", (edited - 10,) * 2)
    os.utime(root / ".venv/.installed", (edited - 5,) * 2)
    for _ in range(2):
        again = make(root, "test", python)
        text, _ = again.communicate(timeout=60)
        assert again.returncode == 0 and "pytest ran" in text, text
    assert [c for c in log.read_text().splitlines() if c.endswith("-e .[test,bench]")] == installs * 2


def test_a_venv_left_half_made_is_made_again(clone):
    root, python, log = clone
    (root / ".venv/bin").mkdir(parents=True)
    (root / ".venv/bin/python").write_text("#!/bin/sh\nexit 1\n")     # no pip: a stopped earlier run
    (root / ".venv/bin/python").chmod(0o755)
    out = make(root, "venv", python)
    text, _ = out.communicate(timeout=60)
    assert out.returncode == 0, text
    assert "ready: run .venv/bin/ipcpool" in text
    assert [c.split()[0] for c in log.read_text().splitlines()] == ["venv", "pip", "pip", "pip"]


def test_nixl_can_be_left_out(clone):
    root, python, log = clone
    out = make(root, "venv", python, "NIXL=")
    text, _ = out.communicate(timeout=60)
    assert out.returncode == 0, text
    calls = log.read_text().splitlines()
    assert [c.split()[0] for c in calls] == ["venv", "pip", "pip"] and "nixl" not in " ".join(calls)


def test_ci_runs_the_readme_test_command():
    assert (ROOT / ".ci/run").read_text().rstrip().endswith("make test")
    assert "make test" in (ROOT / "README.md").read_text()


def test_readme_setup_commands_exist():
    """Every `make TARGET` and `.venv/bin/ipcpool COMMAND` the README's set-up shows is real."""
    import re

    from ipcpool.cli.main import build_parser

    readme = (ROOT / "README.md").read_text()
    setup = readme[readme.index("## Set-up"):readme.index("## A worker")]
    blocks = re.findall(r"```sh\n(.*?)```", setup, re.S)
    commands = [line.split("#")[0].strip() for b in blocks for line in b.splitlines() if line.strip()]
    targets = set(re.findall(r"^([a-z-]+):", (ROOT / "Makefile").read_text(), re.M))
    parser = build_parser()
    seen = set()
    for cmd in commands:
        for part in cmd.split("&&"):
            words = part.split()
            if words[0] == "make":
                assert words[1] in targets, cmd
                seen.add(words[1])
            elif words[0] == ".venv/bin/ipcpool":
                parser.parse_args(words[1:])      # exits (fails the test) on a command it does not know
                seen.add(words[1])
    assert {"venv", "run", "test", "demo", "status"} <= seen
