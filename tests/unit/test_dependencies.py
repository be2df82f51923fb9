"""pyproject.toml says what the code needs: every third-party import of the library is a declared
dependency (torch and CuPy: optional extras), and what relies on private APIs is bounded."""

import ast
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# import name -> distribution name, where they differ
DISTRIBUTION = {"zmq": "pyzmq", "prometheus_client": "prometheus-client", "cupy": "cupy-cuda13x"}


def _name(req: str) -> str:
    return re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0].lower()


def _imports() -> dict[str, set[str]]:
    """Top-level modules imported anywhere in ipcpool/, with the files importing them."""
    found: dict[str, set[str]] = {}
    for path in (ROOT / "ipcpool").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for n in names:
                found.setdefault(n, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_third_party_import_is_declared():
    required = {_name(r) for r in PROJECT["dependencies"]}
    optional = {_name(r) for reqs in PROJECT["optional-dependencies"].values() for r in reqs}
    for module, files in _imports().items():
        top = module.split(".")[0]
        if top in sys.stdlib_module_names or top == "ipcpool":
            continue
        if module.startswith("cuda."):
            dist = "cuda-" + module.split(".")[1]
        else:
            dist = DISTRIBUTION.get(top, top).replace("_", "-").lower()
        if top in ("torch", "cupy", "ml_dtypes"):
            assert dist in optional, f"{module} ({sorted(files)}): no extra installs {dist}"
        else:
            assert dist in required, f"{module} ({sorted(files)}): {dist} is not a declared dependency"


def test_private_cuda_core_modules_mean_an_upper_bound():
    private = [m for m in _imports() if m.startswith("cuda.core._")]
    (core,) = [r for r in PROJECT["dependencies"] if _name(r) == "cuda-core"]
    assert not private or "<" in core, f"{private} are private: bound {core!r}"


def test_the_test_extra_has_what_the_gpu_suite_uses():
    test = {_name(r) for r in PROJECT["optional-dependencies"]["test"]}
    assert "pytest-timeout" in test and "--timeout" in (ROOT / "scripts/gpu_suite.sh").read_text()
    assert {"torch", "cupy"} <= set(PROJECT["optional-dependencies"])
