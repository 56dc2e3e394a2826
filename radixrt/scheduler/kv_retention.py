"""KVRetention: bounded-KV retention's writes to a request's page table, on KVMemory's side.

radixrt/retention/drop_plan.py says what a request under a retention policy drops before a
step; this carries it out against the pool and the prefix cache: private copies of the cache
pages it still reads (first drop), the dropped pages freed, and the cache let go of. It also
accumulates the attention mass the worker reports, which heavy_hitter policies drop by.
"""

from __future__ import annotations

from collections.abc import Callable

from radixrt.cache import PageAllocator, PrefixCache
from radixrt.messages import Retain
from radixrt.retention import drop_plan
from radixrt.scheduler.req import Req
from radixrt.scheduler.slot_copies import SlotCopies


class KVRetention:
    def __init__(self, cache: PrefixCache, allocator: PageAllocator, copies: SlotCopies, page_size: int,
                 alloc: Callable[[int], list[int]]) -> None:
        """alloc(n): n free device pages (KVMemory.alloc: evicting cache leaves if it must)."""
        self.cache, self.allocator, self.copies, self.page_size, self.alloc = cache, allocator, copies, page_size, alloc

    def retain(self, r: Req, n: int) -> Retain | None:
        """Before r runs n more tokens: drop what its retention policy lets go (None: nothing)."""
        p = drop_plan.plan(r.kv, r.retention, n)
        if p is None:
            return None
        kv = r.kv
        if p.copies:  # allocated while the cache still pins the originals: none is evicted from under its copy
            for j, own in zip(p.copies, self.alloc(len(p.copies))):
                self.copies.add(kv.pages[j], own, self.page_size)
                kv.pages[j] = own
        self.allocator.free(p.freed)
        if kv.dropped == 0:  # the first drop: every page is r's own from now on, and r pins no cache node
            if kv.lock_node is not None:
                self.cache.unlock(kv.lock_node)
            kv.tree_pages, kv.dup_pages, kv.lock_node = 0, [], None
        return drop_plan.rewrite(kv, r.retention, p, self.page_size)

    def add_mass(self, r: Req, mass: list[float]) -> None:
        """The worker's per-page attention mass of r's last step (aligned with its page table), for its
        policy's drops."""
        drop_plan.add_mass(r.kv, mass)
