"""Draft trees: the shape of one request's drafts in a verify step, as plain lists.

A tree is given by `parents`: per draft, the index of its parent draft, or -1 when its parent
is the root (the request's last accepted token, the verify step's first row). Drafts come in
topological order (a parent before its children). A chain is the tree [-1, 0, 1, ...]; the
wire form of a chain is an empty list (BatchEntry.draft_parents), so chains cost nothing.

In the verify step the root and the drafts are rows 0 .. len(parents) of the request, each
draft's KV written at its row's cache index (consecutive, as for a chain), its rope position
the root's plus its depth, and its attention over the cached prefix and its own ancestors
(`ancestry`). After verification the kept branch's KV moves down to the cache indices right
after the root (`moves`), where the sequence continues.
"""

from __future__ import annotations


def is_chain(parents: list[int]) -> bool:
    return all(p == j - 1 for j, p in enumerate(parents))


def check_tree(parents: list[int]) -> None:
    """ValueError unless parents is a topologically ordered tree."""
    for j, p in enumerate(parents):
        if not -1 <= p < j:
            raise ValueError(f"draft {j}'s parent {p} is not -1 or an earlier draft")


def depths(parents: list[int]) -> list[int]:
    """Per draft its depth below the root (the root's children: 1)."""
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def ancestry(parents: list[int]) -> list[list[bool]]:
    """[n + 1][n + 1]: row i (0: the root, j + 1: draft j) sees row j iff j is i or an ancestor of it."""
    n = len(parents)
    rows = [[False] * (n + 1) for _ in range(n + 1)]
    rows[0][0] = True
    for j, p in enumerate(parents):
        rows[j + 1] = list(rows[p + 1])
        rows[j + 1][j + 1] = True
    return rows


def walk(draft: list[int], parents: list[int], sampled: list[int]) -> list[int]:
    """The drafts kept: from the root, while the row's sampled token is one of the node's
    children, into that child. sampled[i] is row i's sample (0: the root's, j + 1: draft j's).
    Returns their indices, root side first; the next token is sampled[path[-1] + 1] (or sampled[0])."""
    children: dict[tuple[int, int], int] = {}
    for j, (p, t) in enumerate(zip(parents, draft)):
        children.setdefault((p, t), j)  # a duplicate sibling is never reached: the first one holds its subtree's row
    path, node = [], -1
    while (child := children.get((node, sampled[node + 1]))) is not None:
        path.append(child)
        node = child
    return path


def moves(path: list[int]) -> list[tuple[int, int]]:
    """(from, to) draft indices whose KV moves so that kept draft i sits at draft index i (each
    from > to, and no move reads what an earlier one wrote)."""
    return [(j, i) for i, j in enumerate(path) if j != i]
