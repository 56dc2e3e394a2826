"""RadixCache: a radix tree of token sequences whose values are KV page ids.

Every edge is cut at page boundaries, so a node's pages cover exactly its
tokens. The one exception is a *partial leaf*: the last, incomplete page of
an inserted sequence, kept as a leaf of fewer than page_size tokens so that a
later request can copy its slots (copy-on-write) instead of recomputing them.

Ownership: pages inside the tree belong to the tree. A running request pins
its path with lock(node); eviction frees least-recently-used *unlocked leaves*
first, kept in a SortedList by last access so nothing scans the tree (the
EvictionBook, eviction_book.py, keeps that order and the owners' quotas). A node
whose subtree is unlocked is evictable; its pages count in evictable_pages.
How a query's tokens meet the edges page by page is PageEdges' (page_edges.py).

Namespaces (opaque hashable values: the runtime's CacheNamespace) each get
their own root: requests in different namespaces never share pages. The contract it keeps with its callers
is PrefixCache (prefix_cache.py).
"""

from __future__ import annotations

import itertools
from typing import Callable, Hashable, Iterable, Iterator

from radixrt.cache.eviction import EvictionOrder, Stamp
from radixrt.cache.eviction_book import EvictionBook
from radixrt.cache.page_edges import PageEdges
from radixrt.cache.prefix_cache import InsertResult, MatchResult, Node


class RadixCache:
    def __init__(self, page_size: int, order: EvictionOrder | None = None) -> None:
        self.page_size = page_size
        self.order = order or EvictionOrder()
        self._book = EvictionBook(self.order)  # the evictable leaves in order, owners and quotas
        self._edges = PageEdges(page_size)
        self._ids = itertools.count(1)
        self._clock = itertools.count(1)
        self.roots: dict[Hashable, Node] = {}
        self._namespace_of: dict[int, Hashable] = {}  # root id -> namespace
        self.by_key: dict[str, Node] = {}  # content key of a full page (insert's keys) -> its node
        self.total_pages = 0
        self.evictable_pages = 0  # pages of nodes with lock_ref == 0
        self.evicted_pages = 0  # lifetime counter

    # -- lookup ------------------------------------------------------------------

    def root(self, namespace: Hashable = None) -> Node:
        if namespace not in self.roots:
            self.roots[namespace] = root = Node([], [], None, id=next(self._ids))
            self._namespace_of[root.id] = namespace
        return self.roots[namespace]

    def sequence_of(self, node: Node) -> tuple[Hashable, list[int]]:
        """node's namespace and its whole token sequence from the root (its key is the tail)."""
        keys = []
        while node.parent is not None:
            keys.append(node.key)
            node = node.parent
        return self._namespace_of[node.id], [t for key in reversed(keys) for t in key]

    def sequences(self) -> Iterator[tuple[Hashable, list[int], Node]]:
        """Every node with its namespace and whole token sequence, parents before children."""
        for namespace, root in self.roots.items():
            stack = [(root, [])]
            while stack:
                node, tokens = stack.pop()
                for child in node.children.values():
                    yield namespace, tokens + child.key, child
                    stack.append((child, tokens + child.key))

    def match_prefix(self, tokens: list[int], namespace: Hashable = None, touch: bool = True) -> MatchResult:
        """The longest cached page-aligned prefix of tokens, plus a partial next page
        (what it mutates and how long the result is valid: see PrefixCache)."""
        node, pos, pages = self._descend(self.root(namespace), tokens, next(self._clock) if touch else None, hit=True)
        partial_page, partial_len = self._edges.best_partial(node, tokens[pos : pos + self.page_size])
        return MatchResult(pages, node, self.page_size, partial_page, partial_len)

    def _descend(self, node: Node, tokens: list[int], now: int | None, hit: bool = False) -> tuple[Node, int, list[int]]:
        """Follow tokens down from node through whole matching pages, splitting the last
        node where the match ends inside its edge; touch the path at `now` unless None (a hit:
        a request reads it). Returns the deepest node reached, the tokens matched and their pages."""
        pos, pages = 0, []
        while (child := self._edges.full_child(node, tokens, pos)) is not None:
            k = self._edges.equal_pages(child.key, tokens, pos)
            if k < len(child.pages):
                child = self._split(child, k)
            if now is not None:
                self._book.touch(child, now, hit)
            pages += child.pages
            node, pos = child, pos + len(child.key)
        return node, pos, pages

    # -- insertion -------------------------------------------------------------

    def insert(self, tokens: list[int], pages: list[int], namespace: Hashable = None,
               keys: list[str] | None = None, owner: Hashable = None) -> InsertResult:
        """Add tokens (with their pages) to the tree; the tree keeps what it did not have
        (ownership: see PrefixCache.insert). keys: the content keys of tokens' full pages
        (cache/tier_index.page_keys), kept on the nodes and in by_key; None: none kept."""
        ps = self.page_size
        assert len(pages) == -(-len(tokens) // ps), "pages must cover tokens exactly"
        assert keys is None or len(keys) >= len(tokens) // ps, "keys must cover every full page"
        now = next(self._clock)
        node, pos, matched = self._descend(self.root(namespace), tokens, now)
        existing = len(matched)
        released: list[int] = []
        aligned = len(tokens) // ps * ps
        if pos < aligned:
            released += self._drop_partial_prefixes_of(node, tokens[pos : pos + ps])
            node = self._add_child(node, tokens[pos:aligned], pages[pos // ps : aligned // ps], now, owner,
                                   keys[pos // ps : aligned // ps] if keys is not None else [])
            pos = aligned
        if pos < len(tokens):
            tail = tokens[pos:]
            if any(child.key[: len(tail)] == tail for child in node.children.values()):
                existing += 1  # the tree already has these tokens in some page
            else:
                released += self._drop_partial_prefixes_of(node, tail)
                self._add_child(node, tail, [pages[-1]], now, owner)
        return InsertResult(node, existing, released)

    def _drop_partial_prefixes_of(self, node: Node, first_page: list[int]) -> list[int]:
        """Partial leaves whose tokens a longer child will now cover are redundant."""
        out = []
        for child in list(node.children.values()):
            if len(child.key) < self.page_size and first_page[: len(child.key)] == child.key and child.lock_ref == 0:
                out += self._remove_leaf(child)
        return out

    def _add_child(self, parent: Node, key: list[int], pages: list[int], now: int, owner: Hashable,
                   keys: list[str] = ()) -> Node:
        node = Node(key, pages, parent, id=next(self._ids), start=parent.start + len(parent.key), keys=list(keys),
                    owner=owner)
        self._book.added(node, now)
        for k in node.keys:
            self.by_key[k] = node
        parent.children[self._edges.first_page(key)] = node
        self.total_pages += len(pages)
        self.evictable_pages += len(pages)
        return node

    def _split(self, child: Node, k: int) -> Node:
        """Cut child after k pages; returns the new upper node (which has child below it)."""
        ps = self.page_size
        upper = Node(child.key[: k * ps], child.pages[:k], child.parent, lock_ref=child.lock_ref,
                     stamp=Stamp(**vars(child.stamp)), id=next(self._ids), start=child.start,
                     keys=child.keys[:k], pinned=child.pinned, owner=child.owner)
        for key in upper.keys:
            self.by_key[key] = upper
        child.parent.children[self._edges.first_page(child.key)] = upper
        child.key, child.pages, child.parent = child.key[k * ps :], child.pages[k:], upper
        child.keys, child.start = child.keys[k:], child.start + k * ps  # its sort key (a stamp) stays
        upper.children[self._edges.first_page(child.key)] = child
        return upper

    # -- pinning -----------------------------------------------------------------

    def lock(self, node: Node) -> None:
        """Pin node and its ancestors: none of them is evicted until unlock(node)."""
        while node.parent is not None:
            if node.lock_ref == 0:
                self.evictable_pages -= len(node.pages)
                self._book.leaves.discard(node)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node.parent is not None:
            assert node.lock_ref > 0, "unlock without lock"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_pages += len(node.pages)
                self._book.rejoin(node)
            node = node.parent

    def set_pinned(self, node: Node, pinned: bool) -> None:
        """Order node after (pinned) or among (not) every unpinned leaf; it stays evictable."""
        self._book.set_pinned(node, pinned)

    # -- eviction ------------------------------------------------------------------

    def evict(self, num_pages: int, sink: Callable[[Node], None] | None = None) -> list[int]:
        """Free at least num_pages (if that many are evictable), LRU unlocked leaves first.
        sink, if given, sees each leaf before it leaves the tree (to keep its KV elsewhere)."""
        freed: list[int] = []
        while len(freed) < num_pages and self._book.leaves:
            leaf = self._book.victim()
            if sink is not None:
                sink(leaf)
            self.order.evicted(leaf.stamp)
            freed += self._remove_leaf(leaf)
        self.evicted_pages += len(freed)
        return freed

    def set_quotas(self, quota: Callable[[Hashable], int | None]) -> None:
        self._book.set_quotas(quota)

    def pages_by_owner(self) -> dict[Hashable, int]:
        return self._book.pages_by_owner()

    def _remove_leaf(self, leaf: Node) -> list[int]:
        parent = leaf.parent
        assert parent is not None and leaf.is_leaf and leaf.lock_ref == 0
        for key in leaf.keys:
            del self.by_key[key]
        del parent.children[self._edges.first_page(leaf.key)]
        self._book.removed(leaf)
        self.total_pages -= len(leaf.pages)
        self.evictable_pages -= len(leaf.pages)
        return leaf.pages

    def forget(self, pages: set[int]) -> list[int]:
        """Remove pages whose KV was lost, and every page cached after them (no match can reach
        those any more); returns the pages removed (see PrefixCache.forget)."""
        found: list[tuple[Node, int]] = []  # the topmost nodes holding a lost page, and where in them
        stack = list(self.roots.values())
        while stack:
            for child in stack.pop().children.values():
                k = next((i for i, p in enumerate(child.pages) if p in pages), None)
                if k is None:
                    stack.append(child)
                else:
                    found.append((child, k))
        removed: list[int] = []
        for node, k in found:
            if k > 0:
                self._split(node, k)  # node keeps its pages from the lost one on
            for n in _leaves_first([node]):
                removed += self._remove_leaf(n)
        return removed

    def drop_namespace(self, namespace: Hashable) -> list[int]:
        """Remove every node of namespace that no request holds and no pin keeps (leaves first);
        returns their pages."""
        root = self.roots.get(namespace)
        if root is None:
            return []
        removed: list[int] = []
        for n in _leaves_first(root.children.values()):
            if n.is_leaf and n.lock_ref == 0 and not n.pinned:
                removed += self._remove_leaf(n)
        return removed

    def reset(self) -> list[int]:
        """Empty the tree; returns every page it held. Refuses while any node is locked."""
        if self.evictable_pages != self.total_pages:
            raise RuntimeError("cannot reset the prefix cache while requests hold parts of it")
        pages = self.evict(self.total_pages)
        self.roots.clear()
        self._namespace_of.clear()
        assert not self.by_key
        return pages


def _leaves_first(tops: Iterable[Node]) -> list[Node]:
    """tops and every node below them, each after all its children: removing them in this order
    only ever removes a leaf."""
    order, below = [], list(tops)
    while below:  # parents before children; reversed at the end
        n = below.pop()
        order.append(n)
        below += n.children.values()
    return order[::-1]
