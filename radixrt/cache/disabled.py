"""NoPrefixCache (`--disable-radix-cache`): the PrefixCache contract, caching nothing.

match finds nothing, insert takes no page (every page stays the request's and
is freed when it leaves), and there is never anything to evict or persist.
"""

from __future__ import annotations

from typing import Callable, Hashable, Iterator

from radixrt.cache.prefix_cache import InsertResult, MatchResult, Node


class NoPrefixCache:
    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._root = Node([], [], None)
        self.total_pages = 0
        self.evictable_pages = 0
        self.evicted_pages = 0
        self.by_key: dict[str, Node] = {}

    def match_prefix(self, tokens: list[int], namespace: Hashable = None, touch: bool = True) -> MatchResult:
        return MatchResult([], self._root, self.page_size)

    def insert(self, tokens: list[int], pages: list[int], namespace: Hashable = None,
               keys: list[str] | None = None, owner: Hashable = None) -> InsertResult:
        return InsertResult(self._root, len(pages), [])

    def set_pinned(self, node: Node, pinned: bool) -> None:
        pass

    def set_quotas(self, quota: Callable[[Hashable], int | None]) -> None:
        pass

    def pages_by_owner(self) -> dict[Hashable, int]:
        return {}

    def lock(self, node: Node) -> None:
        pass

    def unlock(self, node: Node) -> None:
        pass

    def evict(self, num_pages: int, sink: Callable[[Node], None] | None = None) -> list[int]:
        return []

    def forget(self, pages: set[int]) -> list[int]:
        return []

    def drop_namespace(self, namespace: Hashable) -> list[int]:
        return []

    def reset(self) -> list[int]:
        return []

    def sequence_of(self, node: Node) -> tuple[Hashable, list[int]]:
        return None, []  # the only node is the root

    def sequences(self) -> Iterator[tuple[Hashable, list[int], Node]]:
        return iter(())
