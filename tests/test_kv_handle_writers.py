"""The single-writer rule for a request's KVHandle (radixrt/scheduler/kv_handle.py), read from the
source with ast: only KVMemory and its collaborators, and retention's drop plan, write one.

A write is an assignment (plain, augmented, or into an item: `kv.pages[j] = p`) to an attribute
of a KVHandle, a call of one of its mutating methods (reset, clear_swap) or of a list method on
one of its fields (`kv.pages.append(p)`), or replacing a request's handle (`r.kv = ...`). A
KVHandle is `<anything>.kv`, a name `kv`, a name bound to one in the same function
(`handle, ps = r.kv, 4`), or a parameter annotated as one (KVHandle, or drop_plan's RetainedKV).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The modules that may write a KVHandle, and nothing else (kv_handle.py's docstring names them too;
# the handle's own reset() and clear_swap() count where they are called).
WRITERS = {
    "radixrt/scheduler/kv_memory.py",  # page tables: admit, grow, advance, cache, release
    "radixrt/scheduler/tier_bridge.py",  # content keys (a memo), what an admission loaded from the tiers
    "radixrt/scheduler/kv_swap.py",  # swap state
    "radixrt/scheduler/kv_retention.py",  # a retention drop's copies and the cache let go of
    "radixrt/retention/drop_plan.py",  # a retention drop's page table rewrite, attention mass
}
HANDLE_TYPES = {"KVHandle", "RetainedKV"}
MUTATORS = {"reset", "clear_swap"}  # KVHandle's methods that write it
LIST_MUTATORS = {"append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse"}


def _is_handle(node: ast.AST, aliases: set[str]) -> bool:
    """node is a KVHandle: `<anything>.kv`, or one of the names bound to one."""
    if isinstance(node, ast.Attribute):
        return node.attr == "kv"
    return isinstance(node, ast.Name) and node.id in aliases


def _aliases(fn: ast.AST) -> set[str]:
    """Names bound to a KVHandle in fn (module level: fn is the module)."""
    names = {"kv"}
    is_fn = isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
    for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs if is_fn else []:
        if a.annotation is not None and any(t in ast.unparse(a.annotation) for t in HANDLE_TYPES):
            names.add(a.arg)
    for node in ast.walk(fn):
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            pairs = [(target, node.value)]
            if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                pairs = list(zip(target.elts, node.value.elts))
            names |= {t.id for t, v in pairs if isinstance(t, ast.Name) and _is_handle(v, names)}
    return names


def _targets(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, ast.Assign):
        found = node.targets
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        found = [node.target]
    elif isinstance(node, ast.Delete):
        found = node.targets
    else:
        return []
    flat: list[ast.AST] = []
    for t in found:
        flat += t.elts if isinstance(t, ast.Tuple) else [t]
    return flat


def _writes(node: ast.AST, aliases: set[str]) -> bool:
    for t in _targets(node):
        if isinstance(t, ast.Attribute) and t.attr == "kv":  # a request's handle replaced
            return True
        while isinstance(t, (ast.Attribute, ast.Subscript)):  # kv.pages[j] = p, kv.x.y = v
            if _is_handle(t.value, aliases):
                return True
            t = t.value
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        owner, name = node.func.value, node.func.attr
        if name in MUTATORS and _is_handle(owner, aliases):
            return True
        if name in LIST_MUTATORS and isinstance(owner, ast.Attribute) and _is_handle(owner.value, aliases):
            return True
    return False


def handle_writes(source: str) -> list[int]:
    """The lines of source that write a KVHandle."""
    tree = ast.parse(source)
    scopes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    lines = set()
    for scope in scopes:
        aliases = _aliases(scope)
        for node in ast.walk(scope):
            if _writes(node, aliases):
                lines.add(node.lineno)
    return sorted(lines)


def test_the_detector_sees_each_kind_of_write():
    src = ("def f(r, kv2: KVHandle):\n"
           "    r.kv.kv_len = 3\n"
           "    h, ps = r.kv, 4\n"
           "    h.pages.append(1)\n"
           "    h.pages[0] = 2\n"
           "    h.dropped += ps\n"
           "    r.kv.reset()\n"
           "    kv2.swap_slots = []\n"
           "    r.kv = None\n"
           "    kv.kv_len += 1\n"
           "    n = r.kv.kv_len + len(h.pages)\n"  # reads are not writes
           "    other.pages.append(1)\n"
           "    x = len(r.kv.pages)\n")
    assert handle_writes(src) == [2, 4, 5, 6, 7, 8, 9, 10]


def test_only_the_named_modules_write_a_kv_handle():
    writers = {}
    for path in sorted((ROOT / "radixrt").rglob("*.py")):
        lines = handle_writes(path.read_text())
        if lines:
            writers[str(path.relative_to(ROOT))] = lines
    stray = {p: lines for p, lines in writers.items() if p not in WRITERS}
    assert not stray, f"only {sorted(WRITERS)} may write a request's KVHandle; these do too: {stray}"
    assert set(writers) == WRITERS, f"named as writers but writing none: {sorted(WRITERS - set(writers))}"
