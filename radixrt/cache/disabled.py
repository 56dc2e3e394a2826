"""NoPrefixCache (`--disable-radix-cache`): the RadixCache interface, caching nothing.

match finds nothing, insert takes no page (every page stays the request's and
is freed when it leaves), and there is never anything to evict.
"""

from __future__ import annotations

from radixrt.cache.radix_cache import InsertResult, MatchResult, Node


class NoPrefixCache:
    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._root = Node([], [], None)
        self.total_pages = 0
        self.evictable_pages = 0
        self.evicted_pages = 0

    def match_prefix(self, tokens: list[int], namespace: str | None = None, touch: bool = True) -> MatchResult:
        return MatchResult([], self._root)

    def insert(self, tokens: list[int], pages: list[int], namespace: str | None = None) -> InsertResult:
        return InsertResult(self._root, len(pages), [])

    def lock(self, node: Node) -> None:
        pass

    def unlock(self, node: Node) -> None:
        pass

    def evict(self, num_pages: int, sink=None) -> list[int]:
        return []

    def reset(self) -> list[int]:
        return []
