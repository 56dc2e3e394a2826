"""KVHandle: one request's KV pages and their state.

Written only by KVMemory and its collaborators, each for its part, and by nothing else:
- scheduler/kv_memory.py: the page table (admit, grow, advance, into the cache, release);
- scheduler/tier_bridge.py: the content keys of its pages (a memo) and what its admission loaded
  from the tiers below the device (`loaded`);
- scheduler/kv_swap.py: its swap state (swap_slots, swapped_len);
- scheduler/kv_retention.py and radixrt/retention/drop_plan.py: a retention drop (private copies,
  the prefix cache let go of, the page table rewritten) and the attention mass it drops by.
tests/test_kv_handle_writers.py reads the source and fails on any other writer.

Everyone else reads it: the scheduler asks how much KV a request has (kv_len),
whether it is swapped out, and the tests which pages it owns.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from radixrt.cache import Node


@dataclass(frozen=True)
class TierLoad:
    """Pages one admission loaded into the device pool from the tiers below it."""

    host_pages: int = 0
    disk_pages: int = 0


@dataclass(eq=False)
class KVHandle:
    pages: list[int] = field(default_factory=list)  # page table: KV of positions [0, kv_len)
    kv_len: int = 0  # tokens whose KV is in `pages`
    pages_sent: int = 0  # leading pages the worker's page table already has
    tree_pages: int = 0  # leading pages covered by the prefix cache (matched or inserted)
    dup_pages: list[int] = field(default_factory=list)  # our pages among those whose tokens the cache already had
    lock_node: Node | None = None  # deepest prefix-cache node this request pins
    page_keys: list[str] = field(default_factory=list)  # content keys of leading full pages (lower tiers); a memo
    loaded: TierLoad = TierLoad()  # what its latest admission loaded from host memory and disk
    swap_slots: list[int] = field(default_factory=list)  # host slots holding its KV while swapped out
    swapped_len: int = 0  # tokens of KV in swap_slots
    # bounded-KV retention: tokens whose pages were dropped (every page is then the request's own, and
    # none goes to the prefix cache), and each page's accumulated attention mass (heavy_hitter)
    dropped: int = 0
    page_mass: list[float] = field(default_factory=list)

    def owns(self, j: int) -> bool:
        """Whether the request owns its j-th page (else the prefix cache does)."""
        return j >= self.tree_pages or self.pages[j] in self.dup_pages

    @property
    def owned_pages(self) -> list[int]:
        """Pages this request must free itself (the rest belong to the prefix cache)."""
        return self.dup_pages + self.pages[self.tree_pages :]

    @property
    def is_swapped(self) -> bool:
        return bool(self.swap_slots)

    def reset(self, pages: list[int] | None = None, kv_len: int = 0) -> None:
        """A fresh page table (none, or `pages` holding kv_len tokens of KV that are all its
        own), with nothing sent to the worker, cached or pinned. Swap state stays."""
        self.pages, self.kv_len = pages if pages is not None else [], kv_len
        self.pages_sent, self.tree_pages, self.dup_pages, self.lock_node = 0, 0, [], None
        self.dropped, self.page_mass = 0, []

    def clear_swap(self) -> None:
        self.swap_slots, self.swapped_len = [], 0
