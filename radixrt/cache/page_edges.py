"""PageEdges: how a token list meets the radix tree's edges, page by page.

A node's children are filed under the first page of their edge; a match descends only through
whole pages that equal the query's, and the query's incomplete next page is matched against the
children by common prefix (a partial page to copy from). Depends on page_size alone; it never
changes the tree. Plain Python.
"""

from __future__ import annotations

from radixrt.cache.prefix_cache import Node


class PageEdges:
    def __init__(self, page_size: int) -> None:
        self.page_size = page_size

    def first_page(self, tokens: list[int]) -> tuple[int, ...]:
        """The key a child whose edge is tokens is filed under in its parent's children."""
        return tuple(tokens[: self.page_size])

    def full_child(self, node: Node, tokens: list[int], pos: int) -> Node | None:
        """node's child whose edge starts with the whole page of tokens at pos (None: no such page or child)."""
        if pos + self.page_size > len(tokens):
            return None
        return node.children.get(tuple(tokens[pos : pos + self.page_size]))

    def equal_pages(self, key: list[int], tokens: list[int], pos: int) -> int:
        """How many whole pages of key equal tokens from pos (the first is known to)."""
        ps, k = self.page_size, 1
        while (k + 1) * ps <= len(key) and key[k * ps : (k + 1) * ps] == tokens[pos + k * ps : pos + (k + 1) * ps]:
            k += 1
        return k

    def best_partial(self, node: Node, nxt: list[int]) -> tuple[int | None, int]:
        """The child page sharing the longest prefix with nxt (the query's next, incomplete page)."""
        best_page, best = None, 0
        # A whole page cannot match here (match_prefix would have descended), so n < page_size.
        for child in node.children.values():
            n = _common_len(child.key, nxt)
            if n > best:
                best_page, best = child.pages[0], n
        return best_page, best


def _common_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
