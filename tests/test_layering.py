"""The import direction of DESIGN.md, and no import cycles, read from the source with ast."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
L0 = {"radixrt", "radixrt.config", "radixrt.errors", "radixrt.sampling_params", "radixrt.messages", "radixrt.ipc", "radixrt.utils",
      "radixrt.retention", "radixrt.stats", "radixrt.config_views", "radixrt.namespace", "radixrt.speculative",
      "radixrt.settings", "radixrt.reasoning", "radixrt.kv_storage"}
# package -> radixrt packages it may import (besides itself)
ALLOWED = {
    "radixrt.kernels": set(),
    "radixrt.cache": set(),
    "radixrt.models": L0 | {"radixrt.kernels"},
    "radixrt.worker": L0 | {"radixrt.kernels", "radixrt.models"},
    "radixrt.constrained": L0,
    "radixrt.scheduler": L0 | {"radixrt.cache", "radixrt.constrained"},
    "radixrt.frontend": L0 | {"radixrt.constrained"},
    "radixrt.lang": {"radixrt", "radixrt.reasoning"},  # reasoning.py: pure Python, the DSL's separate_reasoning
    # the package __init__: lazy exports of the Engine and the DSL (the only runtime file that names lang)
    "radixrt": {"radixrt.engine", "radixrt.config", "radixrt.lang"},
}
COMPOSITION_ROOTS = {"radixrt.engine", "radixrt.server", "radixrt.launch", "radixrt.cli", "radixrt.launch_server",
                     "radixrt.ops"}
PROCESS_MODULES = {"subprocess", "multiprocessing", "radixrt.launch"}  # what starting a process takes


def package_of(path: Path) -> str:
    rel = path.relative_to(ROOT)
    if len(rel.parts) == 2:
        return "radixrt" if rel.stem == "__init__" else "radixrt." + rel.stem
    return "radixrt." + rel.parts[1]


def radixrt_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        for name in names:
            if name.startswith("radixrt"):
                parts = name.split(".")
                found.add(".".join(parts[:2]) if len(parts) > 1 else name)
    return found


def test_imports_point_one_way():
    files = [p for p in (ROOT / "radixrt").rglob("*.py")]
    assert files
    violations = []
    for path in files:
        pkg = package_of(path)
        imports = radixrt_imports(path) - {pkg}
        if "radixrt.lang" in imports and pkg not in ("radixrt.lang", "radixrt"):
            violations.append(f"{path}: the runtime imports radixrt.lang")
        if pkg in ALLOWED:
            bad = imports - ALLOWED[pkg]
            if bad:
                violations.append(f"{path} ({pkg}) imports {sorted(bad)}")
        elif pkg not in COMPOSITION_ROOTS and imports - L0:
            violations.append(f"{path} (L0) imports {sorted(imports - L0)}")
    assert not violations, "\n".join(violations)


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, anywhere in it, as written (`from a.b import c` is a.b)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
    return found


def starts_processes(module: str) -> bool:
    return any(module == m or module.startswith(m + ".") for m in PROCESS_MODULES)


def test_http_starts_no_process_and_the_engine_launches_without_http():
    """radixrt/launch/ starts the processes; radixrt/server/ only serves HTTP over them, so it imports
    neither radixrt.launch nor a way to start a process; the Engine launches without the HTTP server."""
    violations = []
    for path in sorted((ROOT / "radixrt" / "server").rglob("*.py")):
        violations += [f"{path}: imports {m}" for m in sorted(imported_modules(path)) if starts_processes(m)]
    engine = imported_modules(ROOT / "radixrt" / "engine.py")
    assert "radixrt.launch.backend" in engine
    violations += [f"radixrt/engine.py: imports {m}" for m in sorted(engine) if m.split(".")[:2] == ["radixrt", "server"]]
    assert not violations, "\n".join(violations)


def test_import_radixrt_does_not_import_torch():
    code = "import sys, radixrt; assert 'torch' not in sys.modules, 'torch imported'; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


# --- no import cycles, between any two of radixrt's modules ---
#
# The graph has one node per module (a package is its __init__) and an edge for each import
# statement, wherever it is (a function-local import is still a dependency), except under
# `if TYPE_CHECKING:`. `from P import n` is an edge to module P.n when n is a submodule, else
# to P (the name lives in P's __init__). Importing P.m is an edge to P.m only, not to its parent
# packages: Python runs P's __init__ first, but a package's __init__ re-exporting its own
# submodules is the normal shape; a submodule that imports a name back from its package's
# __init__ is an edge like any other, so that loop is reported.


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _runtime_nodes(tree: ast.AST, type_checking: bool = False):
    """Every node of the tree except those under `if TYPE_CHECKING:` (its else branch counts),
    unless type_checking, which keeps those too."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if not type_checking and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
        else:
            stack.extend(ast.iter_child_nodes(node))


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of a dotted name that is one of our modules."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in modules:
            return ".".join(parts[:n])
    return None


def module_imports(name: str, path: Path, modules: dict[str, Path], type_checking: bool = False) -> set[str]:
    """The modules of `modules` that module `name` (at `path`) imports at run time (and for the
    type checker too, with type_checking)."""
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    targets = set()
    for node in _runtime_nodes(ast.parse(path.read_text()), type_checking):
        if isinstance(node, ast.Import):
            targets |= {_known(a.name, modules) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            up = parts[: len(parts) - node.level + 1] if node.level else []  # level 1 is this package
            source = ".".join(up + ([node.module] if node.module else []))
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                targets.add(sub if sub in modules else _known(source, modules))
    return targets - {None, name}


def import_graph(roots: list[Path], base: Path, type_checking: bool = False) -> dict[str, set[str]]:
    modules = {module_name(p, base): p for root in roots for p in root.rglob("*.py")}
    return {name: module_imports(name, path, modules, type_checking) for name, path in modules.items()}


def _cycle_through(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """The shortest chain start -> ... -> start (breadth first), or None."""
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for nxt in sorted(graph[node]):
            if nxt == start:
                chain = [node]
                while chain[-1] != start:
                    chain.append(parent[chain[-1]])
                return chain[::-1] + [start]
            if nxt not in parent:
                parent[nxt] = node
                queue.append(nxt)
    return None


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One shortest cycle for each set of modules that import each other in a loop."""
    cycles: dict[frozenset[str], list[str]] = {}
    for start in sorted(graph):
        chain = _cycle_through(graph, start)
        if chain:
            cycles.setdefault(frozenset(chain), chain)
    return list(cycles.values())


def test_no_import_cycles():
    graph = import_graph([ROOT / "radixrt"], ROOT)
    assert "radixrt.lang.state" in graph and "radixrt.kernels" in graph
    cycles = find_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_import_cycles_for_the_type_checker_either():
    """STYLE.md 17: shared types live in the lowest layer, not in `if TYPE_CHECKING:` imports that
    close a loop (models/ had llama -> parallel -> lora -> llama, config had kv_storage)."""
    cycles = find_cycles(import_graph([ROOT / "radixrt"], ROOT, type_checking=True))
    assert not cycles, "import cycles through TYPE_CHECKING:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_cycle_checker_sees_function_local_imports_not_type_checking(tmp_path):
    files = {
        "__init__.py": "",
        "a.py": "from . import b\n",
        "b.py": "def f():\n    from pkg.a import g\n",  # function-local: still a cycle
        "c.py": "from .d import X\n",
        "d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import Y\nX = 1\n",
    }
    (tmp_path / "pkg").mkdir()
    for name, text in files.items():
        (tmp_path / "pkg" / name).write_text(text)
    graph = import_graph([tmp_path / "pkg"], tmp_path)
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.d"] == set()
    assert find_cycles(graph) == [["pkg.a", "pkg.b", "pkg.a"]]
    typed = import_graph([tmp_path / "pkg"], tmp_path, type_checking=True)
    assert typed["pkg.d"] == {"pkg.c"}
    assert sorted(map(sorted, find_cycles(typed))) == [["pkg.a", "pkg.a", "pkg.b"], ["pkg.c", "pkg.c", "pkg.d"]]
