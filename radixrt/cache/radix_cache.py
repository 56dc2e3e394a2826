"""RadixCache: a radix tree of token sequences whose values are KV page ids.

Every edge is cut at page boundaries, so a node's pages cover exactly its
tokens. The one exception is a *partial leaf*: the last, incomplete page of
an inserted sequence, kept as a leaf of fewer than page_size tokens so that a
later request can copy its slots (copy-on-write) instead of recomputing them.

Ownership: pages inside the tree belong to the tree. A running request pins
its path with lock(node); eviction frees least-recently-used *unlocked leaves*
first, kept in a SortedList by last access so nothing scans the tree. A node
whose subtree is unlocked is evictable; its pages count in evictable_pages.

Namespaces (opaque hashable values: the runtime's CacheNamespace) each get
their own root: requests in different namespaces never share pages. The contract it keeps with its callers
is PrefixCache (prefix_cache.py).
"""

from __future__ import annotations

import itertools
from typing import Callable, Hashable, Iterator

from radixrt.cache.eviction import EvictionOrder, Stamp
from radixrt.cache.leaf_order import LeafOrder
from radixrt.cache.prefix_cache import InsertResult, MatchResult, Node


class RadixCache:
    def __init__(self, page_size: int, order: EvictionOrder | None = None) -> None:
        self.page_size = page_size
        self.order = order or EvictionOrder()
        self._ids = itertools.count(1)
        self._clock = itertools.count(1)
        self.roots: dict[Hashable, Node] = {}
        self._namespace_of: dict[int, Hashable] = {}  # root id -> namespace
        # evictable leaves, first to go first: unpinned before pinned, then in the policy's order
        self._leaves = LeafOrder(key=lambda n: (n.pinned, self.order.key(n.stamp), n.id))
        self._quota: Callable[[Hashable], int | None] | None = None  # set_quotas
        self._owner_pages: dict[Hashable, int] = {}
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
        partial_page, partial_len = self._best_partial(node, tokens[pos : pos + self.page_size])
        return MatchResult(pages, node, self.page_size, partial_page, partial_len)

    def _descend(self, node: Node, tokens: list[int], now: int | None, hit: bool = False) -> tuple[Node, int, list[int]]:
        """Follow tokens down from node through whole matching pages, splitting the last
        node where the match ends inside its edge; touch the path at `now` unless None (a hit:
        a request reads it). Returns the deepest node reached, the tokens matched and their pages."""
        pos, pages = 0, []
        while (child := self._full_child(node, tokens, pos)) is not None:
            k = self._equal_pages(child.key, tokens, pos)
            if k < len(child.pages):
                child = self._split(child, k)
            if now is not None:
                self._touch(child, now, hit)
            pages += child.pages
            node, pos = child, pos + len(child.key)
        return node, pos, pages

    def _full_child(self, node: Node, tokens: list[int], pos: int) -> Node | None:
        ps = self.page_size
        if pos + ps > len(tokens):
            return None
        return node.children.get(tuple(tokens[pos : pos + ps]))

    def _equal_pages(self, key: list[int], tokens: list[int], pos: int) -> int:
        """How many whole pages of key equal tokens from pos (the first is known to)."""
        ps, k = self.page_size, 1
        while (k + 1) * ps <= len(key) and key[k * ps : (k + 1) * ps] == tokens[pos + k * ps : pos + (k + 1) * ps]:
            k += 1
        return k

    def _best_partial(self, node: Node, nxt: list[int]) -> tuple[int | None, int]:
        """The child page sharing the longest prefix with nxt (the query's next, incomplete page)."""
        best_page, best = None, 0
        # A whole page cannot match here (match_prefix would have descended), so n < page_size.
        for child in node.children.values():
            n = _common_len(child.key, nxt)
            if n > best:
                best_page, best = child.pages[0], n
        return best_page, best

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
        self._owner_pages[owner] = self._owner_pages.get(owner, 0) + len(pages)
        self.order.touch(node.stamp, now, node.start, len(key), hit=False)
        for k in node.keys:
            self.by_key[k] = node
        if parent.is_leaf:
            self._leaves.discard(parent)
        parent.children[tuple(key[: self.page_size])] = node
        self.total_pages += len(pages)
        self.evictable_pages += len(pages)
        self._leaves.add(node)
        return node

    def _split(self, child: Node, k: int) -> Node:
        """Cut child after k pages; returns the new upper node (which has child below it)."""
        ps = self.page_size
        upper = Node(child.key[: k * ps], child.pages[:k], child.parent, lock_ref=child.lock_ref,
                     stamp=Stamp(**vars(child.stamp)), id=next(self._ids), start=child.start,
                     keys=child.keys[:k], pinned=child.pinned, owner=child.owner)
        for key in upper.keys:
            self.by_key[key] = upper
        child.parent.children[tuple(child.key[:ps])] = upper
        child.key, child.pages, child.parent = child.key[k * ps :], child.pages[k:], upper
        child.keys, child.start = child.keys[k:], child.start + k * ps  # its sort key (a stamp) stays
        upper.children[tuple(child.key[:ps])] = child
        return upper

    def _touch(self, node: Node, now: int, hit: bool = False) -> None:
        self._restamp(node, lambda: self.order.touch(node.stamp, now, node.start, len(node.key), hit))

    def _restamp(self, node: Node, change: Callable[[], None]) -> None:
        # NOTE: the SortedList finds a node by its sort key: remove it before the key changes.
        in_set = node in self._leaves
        if in_set:
            self._leaves.discard(node)
        change()
        if in_set:
            self._leaves.add(node)

    def set_pinned(self, node: Node, pinned: bool) -> None:
        """Order node after (pinned) or among (not) every unpinned leaf; it stays evictable."""
        if node.pinned != pinned:
            self._restamp(node, lambda: setattr(node, "pinned", pinned))

    # -- pinning -----------------------------------------------------------------

    def lock(self, node: Node) -> None:
        """Pin node and its ancestors: none of them is evicted until unlock(node)."""
        while node.parent is not None:
            if node.lock_ref == 0:
                self.evictable_pages -= len(node.pages)
                self._leaves.discard(node)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node.parent is not None:
            assert node.lock_ref > 0, "unlock without lock"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_pages += len(node.pages)
                if node.is_leaf:
                    self._leaves.add(node)
            node = node.parent

    # -- eviction ------------------------------------------------------------------

    def evict(self, num_pages: int, sink: Callable[[Node], None] | None = None) -> list[int]:
        """Free at least num_pages (if that many are evictable), LRU unlocked leaves first.
        sink, if given, sees each leaf before it leaves the tree (to keep its KV elsewhere)."""
        freed: list[int] = []
        while len(freed) < num_pages and self._leaves:
            leaf = self._next_victim()
            if sink is not None:
                sink(leaf)
            self.order.evicted(leaf.stamp)
            freed += self._remove_leaf(leaf)
        self.evicted_pages += len(freed)
        return freed

    def set_quotas(self, quota: Callable[[Hashable], int | None]) -> None:
        self._leaves.track_owners()
        self._quota = quota

    def pages_by_owner(self) -> dict[Hashable, int]:
        return {o: n for o, n in self._owner_pages.items() if n}

    def _next_victim(self) -> Node:
        """The first unpinned leaf of an owner past its quota, else the first leaf in order."""
        if self._quota is not None:
            over = [o for o, n in self._owner_pages.items() if (q := self._quota(o)) is not None and n > q]
            leaf = self._leaves.first_unpinned_of(over)
            if leaf is not None:
                return leaf
        return self._leaves.first()

    def _remove_leaf(self, leaf: Node) -> list[int]:
        parent = leaf.parent
        assert parent is not None and leaf.is_leaf and leaf.lock_ref == 0
        self._leaves.discard(leaf)
        for key in leaf.keys:
            del self.by_key[key]
        del parent.children[tuple(leaf.key[: self.page_size])]
        self.total_pages -= len(leaf.pages)
        self.evictable_pages -= len(leaf.pages)
        self._owner_pages[leaf.owner] -= len(leaf.pages)
        if parent.parent is not None and parent.is_leaf and parent.lock_ref == 0:
            self._leaves.add(parent)
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
            below, order = [node], []
            while below:  # parents before children; removed in reverse, leaves first
                n = below.pop()
                order.append(n)
                below += n.children.values()
            for n in reversed(order):
                removed += self._remove_leaf(n)
        return removed

    def drop_namespace(self, namespace: Hashable) -> list[int]:
        """Remove every node of namespace that no request holds and no pin keeps (leaves first);
        returns their pages."""
        root = self.roots.get(namespace)
        if root is None:
            return []
        order, below = [], list(root.children.values())
        while below:  # parents before children; removed in reverse, leaves first
            n = below.pop()
            order.append(n)
            below += n.children.values()
        removed: list[int] = []
        for n in reversed(order):
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


def _common_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
