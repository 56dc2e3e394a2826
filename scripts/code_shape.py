"""Print what STYLE.md's sizes flag in radixrt/: files over 400 lines, functions over 50, classes
over 20 methods (issue 32's and issue 57's table). Read with ast; imports nothing of radixrt."""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def shape(package: Path, file_limit: int, func_limit: int, method_limit: int) -> dict[str, list[tuple[str, int]]]:
    files, funcs, classes = [], [], []
    total_lines = 0
    paths = sorted(package.rglob("*.py"))
    for path in paths:
        text = path.read_text()
        rel = str(path.relative_to(package.parent))
        lines = text.count("\n")
        total_lines += lines
        if lines > file_limit:
            files.append((rel, lines))
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                methods = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
                if len(methods) > method_limit:
                    classes.append((f"{rel}:{node.name}", len(methods)))
                for m in methods:
                    size = m.end_lineno - m.lineno + 1
                    if size > func_limit:
                        funcs.append((f"{rel}:{node.name}.{m.name}", size))
            elif isinstance(node, ast.Module):
                for m in node.body:
                    if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and m.end_lineno - m.lineno + 1 > func_limit:
                        funcs.append((f"{rel}:{m.name}", m.end_lineno - m.lineno + 1))
    key = lambda item: -item[1]  # noqa: E731
    return {"summary": [(f"{len(paths)} files", total_lines)], "files": sorted(files, key=key),
            "functions": sorted(funcs, key=key), "classes": sorted(classes, key=key)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--package", default=str(ROOT / "radixrt"))
    ap.add_argument("--file-lines", type=int, default=400)
    ap.add_argument("--function-lines", type=int, default=50)
    ap.add_argument("--methods", type=int, default=20)
    args = ap.parse_args()
    found = shape(Path(args.package), args.file_lines, args.function_lines, args.methods)
    for section, rows in found.items():
        print(f"{section}:")
        for name, count in rows:
            print(f"  {count:6d}  {name}")


if __name__ == "__main__":
    main()
