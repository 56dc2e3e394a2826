"""Draft trees from the n-gram index, shaped as SGLang's NGRAM drafter shapes them (BFS, PROB).

Every suffix of the context that has a continuation in the namespace (an anchor: max_window
down to min_window tokens, and more than `longer_than`) feeds one tree, longest first. Each
anchor walks the trie below it and places the tokens it reads under the tree node of the path
it came by; a token its parent already holds is merged (no duplicate siblings) and the walk
continues from it. The tree's root is the request's last token; a tree path is at most
branch_length tokens, as a `propose` chain is.

- BFS: an anchor of length n starts with breadth (max_window - n) * scale + min_breadth, where
  scale = (max_breadth - min_breadth) / (max_window - min_window + 1), so shorter (less
  certain) anchors spread wider. Breadth first, each trie position offers its max(1, int(b))
  most recently indexed continuations, and its children continue with b - scale.
- PROB: each trie position offers its max_breadth most frequent continuations (ties to the
  latest), each with probability count / (the sum over those offered); a node's score is the
  product along its path, and a max-heap places the best first. As in SGLang, an anchor's heap
  runs dry (or the tree fills) before the next anchor starts.

Inside an edge label the one continuation is the label's next token. With max_breadth 1 the
first anchor places exactly `propose`'s chain (nodes 0 .. len - 1); shorter anchors may then add
more (SGLang merges them too), so the tree is that chain alone only when the first anchor fills
k or no shorter anchor offers another token.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from itertools import count
from operator import attrgetter

from radixrt.speculative.ngram_index import NgramIndex, _Location, _Node

_recency = attrgetter("stamp")
_frequency = attrgetter("count", "stamp")  # ties to the latest


@dataclass(frozen=True)
class DraftTree:
    """Draft tokens as a tree below the request's last token (draft_tree.py's shape)."""

    tokens: list[int]  # in topological order: a parent before its children
    parents: list[int]  # per token: the index of its parent in `tokens`, or -1 for the root


class _Tree:
    """The tree being built, and the trie nodes read for it in an order `_touch` accepts (every
    node after its ancestors)."""

    __slots__ = ("k", "kids", "parents", "tokens", "used")

    def __init__(self, k: int) -> None:
        self.k = k
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.kids: list[dict[int, int]] = [{}]  # kids[i + 1]: node i's children by token; kids[0]: the root's
        self.used: list[_Node] = []

    @property
    def full(self) -> bool:
        return len(self.tokens) >= self.k

    def place(self, parent: int, node: _Node, step: int) -> int:
        """The index of token node.label[step - 1] under `parent`, added unless already there."""
        if step == 1:  # entered `node`
            self.used.append(node)
        token, kids = node.label[step - 1], self.kids[parent + 1]
        here = kids.get(token)
        if here is None:
            here = kids[token] = len(self.tokens)
            self.tokens.append(token)
            self.parents.append(parent)
            self.kids.append({})
        return here

    def run(self, parent: int, node: _Node, offset: int, depth: int, limit: int) -> tuple[int, int, int]:
        """Places the rest of node's label after `offset` as a chain below `parent` (inside an
        edge each position has one continuation), within the depth limit and k; returns the
        (parent, offset, depth) where it stopped."""
        steps = min(len(node.label) - offset, limit - depth, self.k - len(self.tokens))
        for step in range(offset + 1, offset + steps + 1):
            parent = self.place(parent, node, step)
        return parent, offset + steps, depth + steps


def propose_tree(index: NgramIndex, namespace: Hashable, context: Sequence[int], k: int,
                 min_breadth: int, max_breadth: int, longer_than: int = 0) -> DraftTree:
    """At most k drafts continuing `context` (only its last max_window tokens are read) in the
    namespace, shaped by index.match_type; an empty tree when k <= 0 or no anchor. Touches the
    trie nodes it read, as `propose` does. ValueError unless 1 <= min_breadth <= max_breadth."""
    if not 1 <= min_breadth <= max_breadth:
        raise ValueError(f"need 1 <= min_breadth <= max_breadth, got {min_breadth} and {max_breadth}")
    tree, limit = _Tree(k), index.branch_length
    scale = (max_breadth - min_breadth) / (index.max_window - index.min_window + 1)
    for n, anchor in index.anchors(namespace, context, longer_than) if k > 0 else ():
        tree.used.extend(anchor.path)
        if index.match_type == "PROB":
            _grow_likely(tree, anchor, max_breadth, limit)
        else:
            _grow_recent(tree, anchor, (index.max_window - n) * scale + min_breadth, scale, limit)
        if tree.full:
            break
    index._touch(tree.used)
    return DraftTree(tree.tokens, tree.parents)


def _grow_recent(tree: _Tree, anchor: _Location, breadth: float, scale: float, limit: int) -> None:
    """BFS from `anchor`: each position offers its max(1, int(breadth)) latest continuations."""
    queue = deque([(-1, breadth, anchor.path[-1], anchor.offset, 0)])  # (tree parent, breadth, node, offset, depth)
    while queue:
        parent, breadth, node, offset, depth = queue.popleft()
        if not queue and offset < len(node.label):  # alone inside an edge: breadth first is a chain
            parent, offset, deeper = tree.run(parent, node, offset, depth, limit)
            for _ in range(depth, deeper):  # as many subtractions as one by one, for the same floats
                breadth -= scale
            depth = deeper
            if tree.full:
                return
        if depth == limit:
            continue
        for child, step in _latest(node, offset, max(1, int(breadth))):
            if tree.full:
                return
            queue.append((tree.place(parent, child, step), breadth - scale, child, step, depth + 1))


def _grow_likely(tree: _Tree, anchor: _Location, top: int, limit: int) -> None:
    """PROB from `anchor`: the best-scored position next. A child enters the heap only once its
    parent is placed, so parents precede children whatever the ties (which go to the earlier
    offered: the more frequent, then the latest, sibling)."""
    heap: list[tuple[float, int, int, _Node, int, int]] = []  # (-score, tie, tree parent, node, offset, depth)
    tie = count()

    def offer(parent: int, score: float, node: _Node, offset: int, depth: int) -> None:
        if depth < limit:
            for child, step, p in _likeliest(node, offset, top):
                heapq.heappush(heap, (-(score * p), next(tie), parent, child, step, depth + 1))

    offer(-1, 1.0, anchor.path[-1], anchor.offset, 0)
    while heap:
        neg, _, parent, node, step, depth = heapq.heappop(heap)
        here = tree.place(parent, node, step)
        if not heap:  # alone: the rest of its edge keeps its score and comes next anyway
            here, step, depth = tree.run(here, node, step, depth, limit)
        if tree.full:
            return
        offer(here, -neg, node, step, depth)


def _latest(node: _Node, offset: int, breadth: int) -> list[tuple[_Node, int]]:
    """The `breadth` latest continuations of the position `offset` tokens into node's label, as
    (node, offset) after the step."""
    if offset < len(node.label):
        return [(node, offset + 1)]
    if node.children is None:
        return []
    if breadth == 1:
        return [(node.last, 1)]
    return [(kid, 1) for kid in heapq.nlargest(breadth, node.children.values(), key=_recency)]


def _likeliest(node: _Node, offset: int, top: int) -> list[tuple[_Node, int, float]]:
    """The `top` most frequent continuations of a position, as (node, offset, probability)."""
    if offset < len(node.label):
        return [(node, offset + 1, 1.0)]
    if node.children is None:
        return []
    if top == 1:
        return [(node.best, 1, 1.0)]
    kids = heapq.nlargest(top, node.children.values(), key=_frequency)
    total = sum(kid.count for kid in kids)
    return [(kid, 1, kid.count / total) for kid in kids]
