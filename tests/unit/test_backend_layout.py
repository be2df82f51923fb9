"""Where cuda.* may be imported: only the CUDA backend imports it, and only one module there
names cuda.core's private modules (the IPC descriptor constructors it has no public way to)."""

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "ipcpool"
IMPORTS_CUDA = re.compile(r"^\s*(from|import)\s+cuda(\.|\s)", re.M)
PRIVATE_CORE = re.compile(r"cuda\.core\._")


def test_only_the_cuda_backend_imports_cuda():
    hits = [p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py") if IMPORTS_CUDA.search(p.read_text())]
    assert hits and all(h.startswith("backend/cuda/") for h in hits), hits


def test_private_cuda_core_names_stay_in_one_module():
    hits = [p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py") if PRIVATE_CORE.search(p.read_text())]
    assert hits == ["backend/cuda/descriptors.py"]
