"""Running the `ipcpool` command as an operator would, and reading the tables it prints."""

import os
import subprocess
import sys
from pathlib import Path

# The installed `ipcpool` command where there is one beside this interpreter (a venv), else the module.
_SCRIPT = Path(sys.executable).parent / "ipcpool"
IPCPOOL = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "ipcpool"]


def ipcpool_cmd(*args, timeout=120, env=None):
    return subprocess.run([*IPCPOOL, *args], capture_output=True, text=True, timeout=timeout, env=env)


def on_a_terminal(*args, timeout=60) -> tuple[int, str]:
    """Run `ipcpool ARGS` with stdout and stderr on a pseudo-terminal: (exit code, what it showed)."""
    import pty

    master, slave = pty.openpty()
    proc = subprocess.Popen([*IPCPOOL, *args], stdout=slave, stderr=slave)
    os.close(slave)
    seen = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:   # EIO: the terminal's last writer is gone
            break
        if not chunk:
            break
        seen += chunk
    os.close(master)
    return proc.wait(timeout), seen.decode(errors="replace")


def table_rows(text: str) -> list[list[str]]:
    """The lines of a table the CLI printed, split into words; the rule under the header dropped."""
    return [line.split() for line in text.splitlines() if line.strip() and set(line.strip()) != {"─"}]
