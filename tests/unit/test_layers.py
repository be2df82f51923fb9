"""Imports run one way: the backend below the wire and the shared-memory layouts, the layouts below
the backend's users, weights below the client, the command above everything, and no module of
ipcpool/ in an import circle.
Every import counts, those inside functions and under TYPE_CHECKING too."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "ipcpool"

# Circles being untangled in a change of their own; each must still be there (the test says when
# one is gone, so that its entry goes too).
KNOWN_CIRCLES: list[set[str]] = []


def _name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in PACKAGE.rglob("*.py")}


def _resolve(module: str, importer: str, level: int) -> str:
    if not level:
        return module
    base = importer.split(".")
    if not MODULES[importer].name == "__init__.py":
        base = base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _imports(name: str) -> set[str]:
    """The ipcpool modules ``name`` imports (a package's ``__init__`` where it names a package)."""
    out = set()
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node.module or "", name, node.level)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        out |= {t for t in targets if t in MODULES and t != name}
    return out


GRAPH = {name: _imports(name) for name in MODULES}


def _importers_of(below: str, above: str) -> list[str]:
    """Modules under ``below`` that import anything under ``above``."""
    def under(m: str, pkg: str) -> bool:
        return m == pkg or m.startswith(pkg + ".")

    return sorted(f"{m} -> {t}" for m, ts in GRAPH.items() if under(m, below) for t in ts if under(t, above))


def test_the_graph_is_read():
    assert "ipcpool.protocol" in GRAPH["ipcpool.frames"]
    assert "ipcpool.backend.base" in GRAPH["ipcpool.backend.cuda.client_pool"]   # a relative import, 3 dots
    assert "ipcpool.weights.load" in GRAPH["ipcpool._client.client"]              # one inside a function


def test_the_backend_imports_neither_the_wire_nor_the_layouts_nor_their_users():
    for above in ("ipcpool.protocol", "ipcpool.fdpass", "ipcpool.frames", "ipcpool.shm", "ipcpool.broker",
                  "ipcpool._client", "ipcpool.cli"):
        assert _importers_of("ipcpool.backend", above) == []


def test_the_shared_memory_layouts_stand_on_errors_and_ranges_alone():
    allowed = {"ipcpool.errors", "ipcpool.ranges"}
    found = sorted(f"{m} -> {t}" for m, ts in GRAPH.items() if m.startswith("ipcpool.shm")
                   for t in ts if not t.startswith("ipcpool.shm") and t not in allowed)
    assert found == []


def test_weights_stand_below_the_client():
    # The facade passes itself to weights' functions: an import back would tie the two in a loop.
    assert _importers_of("ipcpool.weights", "ipcpool._client") == []


def test_the_client_and_the_broker_never_import_the_fleet():
    # The fleet loads NIXL: a worker or a broker that does not pull must not load it.
    assert _importers_of("ipcpool._client", "ipcpool.fleet") == []
    assert _importers_of("ipcpool.broker", "ipcpool.fleet") == []


def test_nothing_of_the_library_imports_the_command():
    found = [line for line in _importers_of("ipcpool", "ipcpool.cli")
             if not line.startswith(("ipcpool.cli ", "ipcpool.cli.", "ipcpool.__main__ "))]
    assert found == []


def _circles() -> list[set[str]]:
    """Strongly connected sets of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = set()
            while True:
                w = stack.pop()
                on.discard(w)
                scc.add(w)
                if w == v:
                    break
            if len(scc) > 1:
                out.append(scc)

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    circles = _circles()
    assert [c for c in circles if c not in KNOWN_CIRCLES] == []
    assert [c for c in KNOWN_CIRCLES if c not in circles] == [], "untangled: take it off KNOWN_CIRCLES"
