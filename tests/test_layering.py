"""The import direction of DESIGN.md, read from the source with ast."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
L0 = {"radixrt", "radixrt.config", "radixrt.errors", "radixrt.sampling_params", "radixrt.messages", "radixrt.ipc", "radixrt.utils"}
# package -> radixrt packages it may import (besides itself)
ALLOWED = {
    "radixrt.kernels": set(),
    "radixrt.cache": set(),
    "radixrt.models": L0 | {"radixrt.kernels"},
    "radixrt.worker": L0 | {"radixrt.kernels", "radixrt.models"},
    "radixrt.scheduler": L0 | {"radixrt.cache"},
    "radixrt.frontend": L0,
    "radixrt.lang": {"radixrt"},
    # the package __init__: lazy exports of the Engine and the DSL (the only runtime file that names lang)
    "radixrt": {"radixrt.engine", "radixrt.config", "radixrt.lang"},
}
COMPOSITION_ROOTS = {"radixrt.engine", "radixrt.server", "radixrt.cli", "radixrt.launch_server"}
L0_FILES = {"config", "errors", "sampling_params", "messages", "ipc"}


def package_of(path: Path) -> str:
    rel = path.relative_to(ROOT)
    top = {"kernels": "radixrt.kernels", "lang": "radixrt.lang"}.get(rel.parts[0])
    if top:
        return top
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
    files = [p for d in ("radixrt", "kernels", "lang") for p in (ROOT / d).rglob("*.py")]
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


def test_import_radixrt_does_not_import_torch():
    code = "import sys, radixrt; assert 'torch' not in sys.modules, 'torch imported'; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr
