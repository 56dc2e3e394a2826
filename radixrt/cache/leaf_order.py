"""LeafOrder: a cache's evictable leaves in eviction order, and per owner when quotas apply.

The radix tree (radix_cache.py) keeps its unlocked leaves here, first to go first: unpinned
before pinned, then in the eviction policy's order. With owners tracked (a tenant's quota in
pages), each owner's leaves are also kept in the same order, so the first unpinned leaf of an
owner over its quota is found without a scan.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator

from sortedcontainers import SortedList

from radixrt.cache.prefix_cache import Node


class LeafOrder:
    def __init__(self, key: Callable[[Node], tuple]) -> None:
        self._key = key
        self._all = SortedList(key=key)
        self._by_owner: dict[Hashable, SortedList] | None = None  # None: owners not tracked

    def track_owners(self) -> None:
        """Keep each owner's leaves apart from now on (before any leaf is added)."""
        assert not self._all, "owners must be tracked from the start"
        self._by_owner = {}

    def __contains__(self, node: Node) -> bool:
        return node in self._all

    def __bool__(self) -> bool:
        return bool(self._all)

    def __iter__(self) -> Iterator[Node]:
        return iter(self._all)

    def first(self) -> Node:
        return self._all[0]

    def add(self, node: Node) -> None:
        self._all.add(node)
        if self._by_owner is not None:
            self._by_owner.setdefault(node.owner, SortedList(key=self._key)).add(node)

    def discard(self, node: Node) -> None:
        """Remove node if present (it must still have the sort key it was added with)."""
        if node in self._all:
            self._all.remove(node)
            if self._by_owner is not None:
                self._by_owner[node.owner].remove(node)

    def first_unpinned_of(self, owners: Iterable[Hashable]) -> Node | None:
        """The first unpinned leaf, in eviction order, among these owners' (None: none)."""
        if self._by_owner is None:
            return None
        heads = [leaves[0] for o in owners if (leaves := self._by_owner.get(o)) and not leaves[0].pinned]
        return min(heads, key=self._key) if heads else None
