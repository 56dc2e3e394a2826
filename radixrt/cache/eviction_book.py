"""EvictionBook: the radix tree's eviction side. Which unlocked leaves may go and in what order
(unpinned before pinned, then the eviction policy's), how many pages each owner holds, and which
owner is past its quota, so that evict() finds its next victim without scanning the tree.

The tree (radix_cache.py) tells it when a node is added, removed, touched, locked or unlocked;
it never changes the tree's shape or its page counts. Plain Python.
"""

from __future__ import annotations

from typing import Callable, Hashable

from radixrt.cache.eviction import EvictionOrder
from radixrt.cache.leaf_order import LeafOrder
from radixrt.cache.prefix_cache import Node


class EvictionBook:
    def __init__(self, order: EvictionOrder) -> None:
        self.order = order
        # evictable leaves, first to go first: unpinned before pinned, then in the policy's order
        self.leaves = LeafOrder(key=lambda n: (n.pinned, self.order.key(n.stamp), n.id))
        self._quota: Callable[[Hashable], int | None] | None = None  # set_quotas
        self._owner_pages: dict[Hashable, int] = {}

    def added(self, node: Node, now: int) -> None:
        """node, new and unlocked, is about to hang below node.parent: it is stamped at now, its
        pages count for its owner, and it takes its parent's place among the evictable leaves."""
        self._owner_pages[node.owner] = self._owner_pages.get(node.owner, 0) + len(node.pages)
        self.order.touch(node.stamp, now, node.start, len(node.key), hit=False)
        if node.parent.is_leaf:
            self.leaves.discard(node.parent)
        self.leaves.add(node)

    def removed(self, leaf: Node) -> None:
        """leaf was unlinked from its parent (which it still names): its pages no longer count,
        and the parent may now be an evictable leaf."""
        self.leaves.discard(leaf)
        self._owner_pages[leaf.owner] -= len(leaf.pages)
        self.rejoin(leaf.parent)

    def rejoin(self, node: Node) -> None:
        """node joins the evictable leaves if it now is one: a leaf below a root that no lock holds."""
        if node.parent is not None and node.is_leaf and node.lock_ref == 0:
            self.leaves.add(node)

    def touch(self, node: Node, now: int, hit: bool = False) -> None:
        self._restamp(node, lambda: self.order.touch(node.stamp, now, node.start, len(node.key), hit))

    def set_pinned(self, node: Node, pinned: bool) -> None:
        """Order node after (pinned) or among (not) every unpinned leaf; it stays evictable."""
        if node.pinned != pinned:
            self._restamp(node, lambda: setattr(node, "pinned", pinned))

    def _restamp(self, node: Node, change: Callable[[], None]) -> None:
        # NOTE: the SortedList finds a node by its sort key: remove it before the key changes.
        in_set = node in self.leaves
        if in_set:
            self.leaves.discard(node)
        change()
        if in_set:
            self.leaves.add(node)

    def victim(self) -> Node:
        """The first unpinned leaf of an owner past its quota, else the first leaf in order
        (there must be one)."""
        if self._quota is not None:
            over = [o for o, n in self._owner_pages.items() if (q := self._quota(o)) is not None and n > q]
            leaf = self.leaves.first_unpinned_of(over)
            if leaf is not None:
                return leaf
        return self.leaves.first()

    def set_quotas(self, quota: Callable[[Hashable], int | None]) -> None:
        self.leaves.track_owners()
        self._quota = quota

    def pages_by_owner(self) -> dict[Hashable, int]:
        return {o: n for o, n in self._owner_pages.items() if n}
