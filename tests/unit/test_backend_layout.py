"""Where cuda.* may be imported: only the CUDA backend imports it, and nothing names cuda.core's
private modules or constructors (what cuda.core has no public way to do goes through cuda.bindings)."""

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "ipcpool"
IMPORTS_CUDA = re.compile(r"^\s*(from|import)\s+cuda(\.|\s)", re.M)
PRIVATE_CORE = re.compile(r"cuda\.core\._[a-z]|Descriptor\._init|__reduce__\(\)")
ROOT = PACKAGE.parent


def test_only_the_cuda_backend_imports_cuda():
    hits = [p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py") if IMPORTS_CUDA.search(p.read_text())]
    assert hits and all(h.startswith("backend/cuda/") for h in hits), hits


def test_no_private_cuda_core_names():
    files = [p for d in ("ipcpool", "bench", "scripts") for p in (ROOT / d).rglob("*.py")]
    hits = [p.relative_to(ROOT).as_posix() for p in files if PRIVATE_CORE.search(p.read_text())]
    assert len(files) > 40 and hits == []
