"""The prefix-cache contract: what KVMemory may assume of RadixCache and NoPrefixCache.

A prefix cache maps token sequences (per namespace) to the KV pages that hold
them. Pages it holds are its own; a caller pins the pages it reads by locking
the node a match or an insert returned. A namespace is any hashable value the
caller chooses (the runtime's CacheNamespace; None by default): the cache only
compares namespaces, and sequences in different ones never share a page.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterator, Protocol

from radixrt.cache.eviction import Stamp


@dataclass(eq=False)
class Node:
    """A tree node: the tokens on the edge into it and the pages that hold them.
    To a caller it is an opaque handle to lock, unlock and name a sequence by."""

    key: list[int]  # tokens on the edge into this node
    pages: list[int]  # ceil(len(key) / page_size) page ids
    parent: Node | None
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)  # by first page of their key
    lock_ref: int = 0  # running requests whose locked path passes through here
    stamp: Stamp = field(default_factory=Stamp)  # the eviction policy's state (cache/eviction.py)
    id: int = 0
    start: int = 0  # tokens from the root to the start of key
    keys: list[str] = field(default_factory=list)  # content keys of its full pages, when the caller gave them
    pinned: bool = False  # ordered after every unpinned leaf (a pinned prompt's pages: see KVMemory)
    owner: Hashable = None  # who inserted its pages (a tenant): whose quota they count in

    @property
    def last_access(self) -> int:
        return self.stamp.last_access

    @property
    def is_leaf(self) -> bool:
        return not self.children


@dataclass(frozen=True)
class MatchResult:
    """pages: the matched full pages (valid as long as the PrefixCache contract says).
    partial_page/partial_len: the next page's first partial_len tokens also
    match; copy them (never write to that page) to reuse them."""

    pages: list[int]
    node: Node
    page_size: int
    partial_page: int | None = None
    partial_len: int = 0

    @property
    def matched_len(self) -> int:
        """Tokens whose KV the match provides: its full pages and the partial page's prefix."""
        return len(self.pages) * self.page_size + self.partial_len


@dataclass(frozen=True)
class InsertResult:
    """node: the deepest full-page node of the inserted sequence (lock it to pin it).
    existing_pages: how many leading pages' tokens the cache already held; the
    caller's pages there were not taken and stay the caller's (the rest now
    belong to the cache). released_pages: cache pages the insert made redundant;
    the caller returns them to the allocator."""

    node: Node
    existing_pages: int
    released_pages: list[int]


class PrefixCache(Protocol):
    """The contract. Every page is free, owned by a request, or held by the cache;
    total_pages counts the cache's, evictable_pages those no lock pins, and
    evicted_pages every page evict() has given up since the start."""

    page_size: int
    total_pages: int
    evictable_pages: int
    evicted_pages: int
    by_key: dict[str, Node]  # the node holding each full page whose content key insert was given

    def match_prefix(self, tokens: list[int], namespace: Hashable = None, touch: bool = True) -> MatchResult:
        """The longest cached page-aligned prefix of tokens, plus a partial next page.

        Mutates: with touch, the matched path becomes most recently used. With or
        without touch, a match that ends inside a node's edge splits that node at
        the page boundary (which pages are cached, evictable or locked does not change).
        Valid: the returned pages and partial page until the next evict() or reset(),
        unless lock(result.node) pins the full pages first (the partial page is
        never pinned: copy it before anything can be evicted)."""
        ...

    def insert(self, tokens: list[int], pages: list[int], namespace: Hashable = None,
               keys: list[str] | None = None, owner: Hashable = None) -> InsertResult:
        """Add tokens, whose KV is in pages (ceil(len(tokens) / page_size) of them); keys, if
        given, are the content keys of tokens' full pages (new nodes keep theirs, in by_key).
        owner: whose quota the pages new to the cache count in (set_quotas).

        Ownership: the cache takes the pages of tokens it did not hold; the caller
        keeps the first existing_pages pages and returns released_pages to the
        allocator. Mutates the inserted path's recency. The result's node is not
        locked: lock it before anything can be evicted, to keep using the pages."""
        ...

    def lock(self, node: Node) -> None:
        """Pin node and the path above it: none of their pages is evicted until unlock(node)."""
        ...

    def unlock(self, node: Node) -> None:
        """Undo one lock(node). Unlocking what was not locked is a bug (AssertionError)."""
        ...

    def evict(self, num_pages: int, sink: Callable[[Node], None] | None = None) -> list[int]:
        """Give up at least num_pages unlocked pages (fewer if fewer are evictable), leaves
        only, in the eviction policy's order with pinned leaves last; the caller frees the returned pages.
        sink, if given, sees each leaf before it leaves (to keep its KV in a lower tier)."""
        ...

    def set_pinned(self, node: Node, pinned: bool) -> None:
        """Order node among the last leaves to go (pinned) or by the policy alone (not)."""
        ...

    def set_quotas(self, quota: Callable[[Hashable], int | None]) -> None:
        """From now on (before anything is inserted), evict() first takes the unpinned leaves of
        owners holding more pages than quota(owner) (None: no quota), then follows its order."""
        ...

    def pages_by_owner(self) -> dict[Hashable, int]:
        """The pages the cache holds, by owner."""
        ...

    def forget(self, pages: set[int]) -> list[int]:
        """Remove the given pages (their KV turned out to be lost: a failed load), with every page
        after them in their sequences; returns the pages removed, for the caller to free. A locked
        node among them is a bug (AssertionError): release whatever reads them first."""
        ...

    def drop_namespace(self, namespace: Hashable) -> list[int]:
        """Remove namespace's nodes that no lock or pin holds; returns their pages, for the caller to free."""
        ...

    def reset(self) -> list[int]:
        """Forget everything; returns every page held. Raises RuntimeError while a lock is held."""
        ...

    def sequence_of(self, node: Node) -> tuple[Hashable, list[int]]:
        """node's namespace and its whole token sequence from the root."""
        ...

    def sequences(self) -> Iterator[tuple[Hashable, list[int], Node]]:
        """Every node below the roots with its namespace and whole sequence, parents first."""
        ...
