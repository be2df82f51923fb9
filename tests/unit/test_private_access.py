"""No module of the library reads another module's private names: ``x._name`` where ``x`` is not
``self``/``cls`` is allowed only for a name a class of the same module defines (its instances
are that module's own business), and ``from m import _name`` not at all. A module's private names
change without notice to the modules around it: a part that needs one asks for a public name.

The heuristic reads each module alone (``ast``): a private name counts as the module's own when
one of its classes assigns it on ``self``, defines it in its body, or lists it in ``__slots__``.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "ipcpool"

# (module under ipcpool/, the expression as written) -> why it stays. Short, each with its reason.
ALLOWED = {
    # torch keeps no public way to swap a module's parameter or buffer in place that keeps a
    # buffer's persistence; these are the dicts torch's own load_state_dict(assign=True) writes.
    ("weights/modules.py", "owner._parameters"): "torch.nn.Module internals (no public equivalent)",
    ("weights/modules.py", "owner._buffers"): "torch.nn.Module internals (no public equivalent)",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own_names(tree: ast.Module) -> set[str]:
    own: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    own.add(item.name)
                elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                    for t in item.targets if isinstance(item, ast.Assign) else [item.target]:
                        if isinstance(t, ast.Name):
                            own.add(t.id)
                            if t.id == "__slots__" and isinstance(item.value, (ast.Tuple, ast.List)):
                                own.update(e.value for e in item.value.elts if isinstance(e, ast.Constant))
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
              and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            own.add(node.attr)
    return own


def _imported(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def findings() -> list[tuple[str, int, str]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        tree = ast.parse(path.read_text())
        own, imported = _own_names(tree), _imported(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                out += [(rel, node.lineno, f"from {'.' * node.level}{node.module or ''} import {a.name}")
                        for a in node.names if _private(a.name)]
            if not isinstance(node, ast.Attribute) or not _private(node.attr):
                continue
            value = node.value
            if isinstance(value, ast.Name) and value.id in ("self", "cls"):
                continue
            # A module's private name is never ours; an instance's is where a class here defines it.
            if node.attr in own and not (isinstance(value, ast.Name) and value.id in imported):
                continue
            out.append((rel, node.lineno, ast.unparse(node)))
    return out


def _allowed(rel: str, expr: str) -> bool:
    return (rel, expr) in ALLOWED


def test_no_module_reads_another_modules_private_names():
    bad = [f"{rel}:{line}: {expr}" for rel, line, expr in findings() if not _allowed(rel, expr)]
    assert bad == [], "private names read from outside their module:\n" + "\n".join(bad)


def test_every_allowance_is_still_needed():
    seen = {(rel, expr) for rel, _, expr in findings()}
    assert set(ALLOWED) <= seen, set(ALLOWED) - seen


def test_the_heuristic_sees_what_it_should():
    tree = ast.parse("class A:\n    def f(self, other):\n        self._x = other._x\n")
    assert _own_names(tree) == {"f", "_x"}
