"""KVMemory: which KV page belongs to whom, for the scheduler.

It and its collaborators below alone write a request's KVHandle (r.kv): pages, pins, tier and
swap state (kv_handle.py names them; tests/test_kv_handle_writers.py holds them to it).

Joins the page allocator and the prefix cache. A request's page table starts
with the pages its prefix matched (held by the cache, pinned by a lock), may
continue with a private copy of a partially matching page (copy-on-write: the
worker copies those slots before the step; the shared page is never written),
and then with pages it allocated. As its prefill progresses its full pages
move into the cache, so concurrent and later requests hit them; when it
leaves, everything it computed goes into the cache and it frees only what it
still owns.

Its collaborators, reached as attributes:
- bridge (tier_bridge.py): with KVTiers (the hierarchical cache), evicted cache leaves keep
  their KV in host memory or on disk, a match that stops in the tree goes on into those tiers
  and loads what they hold, and the moves this makes go to the worker;
- swap (kv_swap.py): a retracted request may park its pages in host memory;
- retention (kv_retention.py): a request under a retention policy drops pages as it runs;
- pins (kv_pins.py): a request's cache_control ttl. With a host tier to move down to, a pinned
  page is evicted last and only downwards; without one, its node stays locked on the device
  until the TTL ends;
- copies (slot_copies.py): the copy-on-write slot copies for the next batch.

Invariant: allocator free + cache total + every request's owned pages == pool.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable

from radixrt.cache import MatchResult, NoPrefixCache, PageAllocator, PrefixCache, RadixCache
from radixrt.cache.eviction import EvictionOrder
from radixrt.namespace import CacheNamespace
from radixrt.retention import drop_plan
from radixrt.scheduler.kv_pins import KVPins
from radixrt.scheduler.kv_retention import KVRetention
from radixrt.scheduler.kv_swap import KVSwap
from radixrt.scheduler.kv_tiers import KVTiers, no_tier_stats
from radixrt.scheduler.req import Req
from radixrt.scheduler.slot_copies import SlotCopies
from radixrt.scheduler.tier_bridge import TierBridge, content_keys

logger = logging.getLogger(__name__)


class KVMemory:
    def __init__(self, num_pages: int, page_size: int, use_cache: bool = True, tiers: KVTiers | None = None,
                 order: EvictionOrder | None = None, pinned_fraction: float = 0.0,
                 pinned_namespace_fraction: float = 1.0) -> None:
        self.page_size = page_size
        self.allocator = PageAllocator(num_pages)
        self.cache: PrefixCache = RadixCache(page_size, order) if use_cache else NoPrefixCache(page_size)
        self.tiers = tiers
        self.keyed = tiers is not None and tiers.cache_on_host  # tree nodes carry content keys
        below = tiers.host.capacity if self.keyed else 0
        capacity = int(pinned_fraction * (num_pages + below)) if use_cache else 0
        if self.keyed:  # every pinned page must fit below the device when it moves down
            capacity = min(capacity, below + (tiers.disk.capacity if tiers.disk is not None else 0))
        keys = functools.partial(content_keys, page_size=page_size)
        self.pins = KVPins(self.cache, tiers, self.keyed, page_size, capacity,
                           int(pinned_namespace_fraction * capacity), keys)
        if tiers is not None:
            tiers.on_device = self.cache.by_key.__contains__
        self.copies = SlotCopies(page_size)
        self.bridge = TierBridge(self.cache, self.allocator, tiers, self.keyed, page_size, self.pins, self.alloc)
        self.swap = KVSwap(tiers, page_size, self.alloc)
        self.retention = KVRetention(self.cache, self.allocator, self.copies, page_size, self.alloc)

    def set_quotas(self, quota: Callable[[str], int | None] | None) -> None:
        """Tenants' quotas in device pages (scheduler/tenants.py; None: no quotas): the cache evicts
        an over-quota tenant's pages first, and pins count toward the quota."""
        if quota is not None:
            self.cache.set_quotas(quota)
            self.pins.quota = quota

    @property
    def available(self) -> int:
        """Pages that can be had now: free, or freed by evicting unpinned cache leaves."""
        return self.allocator.num_free + self.cache.evictable_pages

    # -- admission -------------------------------------------------------------------

    def match(self, r: Req) -> MatchResult:
        """r's reusable prefix in the tree. Nothing is pinned: the result is good until the
        next allocation, so pass it to admit() before allocating anything."""
        m = self.cache.match_prefix(r.tokens(0, r.match_limit), r.namespace)
        self.bridge.hit(m.node)
        return m

    def prefix_len(self, r: Req) -> int:
        """Tokens of r the cache holds now, in the tree or below it, without touching LRU order (for the policy)."""
        m = self.cache.match_prefix(r.tokens(0, r.match_limit), r.namespace, touch=False)
        below = self.bridge.tier_keys(r, len(m.pages))
        if below:
            return (len(m.pages) + self.tiers.hits(below)) * self.page_size
        return m.matched_len

    def admit(self, r: Req, m: MatchResult, n: int, reserve: int) -> bool:
        """Start r's page table from its match m (fresh from match(r)) if the pages to run its
        next n tokens fit with `reserve` pages kept back; False, changing nothing, if not.
        The match is pinned, goes on into the lower tiers as far as the pages allow (loading
        replaces computing), and a partial page's slots are copied into a page of r's own."""
        self.cache.lock(m.node)  # first: the match's own pages are not available to it
        if math.ceil((m.matched_len + n) / self.page_size) - len(m.pages) + reserve > self.available:
            self.cache.unlock(m.node)
            return False
        full = self.bridge.extend(r, m, self.available - reserve)
        kv = r.kv
        kv.reset(list(full.pages), len(full.pages) * self.page_size)
        kv.tree_pages, kv.lock_node = len(full.pages), full.node
        if full.partial_len:
            (own,) = self.alloc(1)
            self.copies.add(full.partial_page, own, full.partial_len)
            kv.pages.append(own)
            kv.kv_len += full.partial_len
        return True

    # -- growth ------------------------------------------------------------------------

    def pages_needed(self, r: Req, n: int) -> int:
        """Pages r's next n tokens take from the pool (net of what its retention policy drops first)."""
        p = drop_plan.plan(r.kv, r.retention, n)
        if p is not None:
            return p.pages_needed(r.kv.kv_len, n, self.page_size)
        return max(0, math.ceil((r.kv.kv_len + n) / self.page_size) - len(r.kv.pages))  # drafts may have left some

    def fit_tokens(self, r: Req, n: int) -> int:
        """The most of r's next n tokens whose pages can be had now."""
        if r.retention is not None:  # a chunk at most; its drops make room as it goes
            n = min(n, r.retention.chunk_tokens)
            while n > 0 and self.pages_needed(r, n) > self.available:
                n = max(0, n - self.page_size)
            return n
        capacity = (len(r.kv.pages) + self.available) * self.page_size - r.kv.kv_len
        return max(0, min(n, capacity))

    def alloc(self, n: int) -> list[int]:
        """n free pages, evicting least-recently-used cache leaves if needed."""
        short = n - self.allocator.num_free
        if short > 0:
            freed = self.cache.evict(short, sink=self.bridge.offload_leaf if self.tiers is not None else None)
            logger.debug("evicted %d cached pages", len(freed))
            self.allocator.free(freed)
        return self.allocator.alloc(n)

    def grow(self, r: Req, n: int) -> list[int]:
        """Pages for r's next n tokens; returns the page-table delta the worker has not seen."""
        kv = r.kv
        kv.pages += self.alloc(self.pages_needed(r, n))
        delta = kv.pages[kv.pages_sent :]
        kv.pages_sent = len(kv.pages)
        return delta

    def advance(self, r: Req, n: int) -> None:
        """The worker computed the KV of r's next n tokens (into the pages grow() gave)."""
        r.kv.kv_len += n

    def keep_to(self, r: Req, n: int) -> None:
        """r keeps the KV of at most its first n tokens (drafts a verify step accepted past a stop
        that ended r): what follows is never cached, and its pages are freed with r's extra ones."""
        r.kv.kv_len = min(r.kv.kv_len, n - r.kv.dropped)

    # -- into the cache, and out ---------------------------------------------------------

    def cache_progress(self, r: Req) -> None:
        """Hand r's full computed pages to the cache (r keeps using them, pinned); not after a drop."""
        if r.kv.dropped:
            return
        full = r.kv.kv_len // self.page_size
        if full > r.kv.tree_pages:
            self._insert(r, full * self.page_size)

    def release(self, r: Req) -> None:
        """r leaves (finished, aborted or retracted): cache what it computed, free what it owns."""
        kv = r.kv
        kept = math.ceil(kv.kv_len / self.page_size)
        extra = kv.pages[kept:]  # allocated for a step that never ran
        kv.pages = kv.pages[:kept]
        if kv.kv_len > 0 and not kv.dropped:  # KV computed after a drop never goes to the cache
            self._insert(r, kv.kv_len)
            self.pins.lock_on_release(r)
        self.allocator.free(kv.owned_pages + extra)
        if kv.lock_node is not None:
            self.cache.unlock(kv.lock_node)
        kv.reset()

    def _insert(self, r: Req, n_tokens: int) -> None:
        kv, n_pages, full = r.kv, math.ceil(n_tokens / self.page_size), n_tokens // self.page_size
        keys = content_keys(r, full, self.page_size) if self.keyed else None
        res = self.cache.insert(r.tokens(0, n_tokens), kv.pages[:n_pages], r.namespace, keys, r.tenant)
        if keys is not None and res.existing_pages < full:  # pages new to the tree
            self.pins.flag(res.node)
            if self.tiers.write_policy == "write_through":
                self.bridge.write_through(r, keys, res.existing_pages, full)
        # Pages the cache already had stay ours (we still read them); the rest are now the cache's.
        if res.existing_pages > kv.tree_pages:
            kv.dup_pages += kv.pages[kv.tree_pages : res.existing_pages]
        kv.tree_pages = max(kv.tree_pages, n_pages)
        self.allocator.free(res.released_pages)
        self.cache.lock(res.node)
        if kv.lock_node is not None:
            self.cache.unlock(kv.lock_node)
        kv.lock_node = res.node

    def flush(self) -> None:
        """Forget every cached page on the device and in host memory, and every pin (the disk tier is
        persistent storage: it stays, as it would across a restart, but for pages only those reached)."""
        self.pins.clear()
        self.allocator.free(self.cache.reset())
        if self.tiers is not None:
            self.tiers.host_tier.clear()

    def drop_namespace(self, namespace: CacheNamespace) -> None:
        """Forget namespace's cached pages in every tier (a LoRA adapter left); pages that running
        requests hold or pins keep stay until they are released."""
        self.allocator.free(self.cache.drop_namespace(namespace))
        if self.tiers is not None:
            self.tiers.drop_namespace(namespace)

    @property
    def used_pages(self) -> int:
        """Pages the requests hold (by the invariant: neither free nor the cache's)."""
        return self.allocator.num_pages - self.allocator.num_free - self.cache.total_pages

    def stats(self) -> dict[str, int]:
        """Pool, cache and tier counters."""
        alloc, cache = self.allocator, self.cache
        return {
            "num_pages": alloc.num_pages,
            "free_pages": alloc.num_free,
            "cached_pages": cache.total_pages,
            "evictable_pages": cache.evictable_pages,
            "used_pages": self.used_pages,
            "evicted_pages": cache.evicted_pages,
            **(self.tiers.stats() if self.tiers is not None else no_tier_stats()),
            **self.pins.table.stats(),
        }
