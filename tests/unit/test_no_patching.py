"""No benchmark replaces a function of ipcpool's at run time (which would freeze private names
against every refactor): what a diagnostic needs to see, it takes from ``ipcpool.trace``."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def replacements(source: str) -> list[tuple[int, str]]:
    """(line, target) of each attribute set to a function (a ``def`` of the file or a lambda), and
    of each ``setattr`` call."""
    tree = ast.parse(source)
    defs = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            found.append((node.lineno, "setattr"))
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            pairs = zip(target.elts, node.value.elts) if isinstance(target, ast.Tuple) and isinstance(
                node.value, ast.Tuple) else [(target, node.value)]
            for t, v in pairs:
                if isinstance(t, ast.Attribute) and (isinstance(v, ast.Lambda) or isinstance(v, ast.Name) and v.id in defs):
                    found.append((node.lineno, ast.unparse(t)))
    return sorted(found)


def test_the_check_sees_the_ways_a_method_is_replaced():
    patched = '''
def traced(op): pass
def stamped(self, data): pass
c._channel.send = traced
server.Broker._on_frame, server.Broker.send = stamped, traced
setattr(handlers.Handlers, "op_create", traced)
obj.hook = lambda: None
h._mapping.follows = False
'''
    assert replacements(patched) == [(4, "c._channel.send"), (5, "server.Broker._on_frame"), (5, "server.Broker.send"),
                                     (6, "setattr"), (7, "obj.hook")]


@pytest.mark.parametrize("path", sorted((ROOT / "bench").glob("*.py")) + sorted((ROOT / "scripts").glob("*.py")),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_no_benchmark_replaces_a_function(path):
    assert replacements(path.read_text()) == []
