"""KVMemory: which KV page belongs to whom, for the scheduler.

It alone writes a request's KVHandle (r.kv): pages, pins, tier and swap state.

Joins the page allocator and the prefix cache. A request's page table starts
with the pages its prefix matched (held by the cache, pinned by a lock), may
continue with a private copy of a partially matching page (copy-on-write: the
worker copies those slots before the step; the shared page is never written),
and then with pages it allocated. As its prefill progresses its full pages
move into the cache, so concurrent and later requests hit them; when it
leaves, everything it computed goes into the cache and it frees only what it
still owns.

With KVTiers (the hierarchical cache, or swap preemption), evicted cache leaves
keep their KV in host memory or on disk, a match that stops in the tree goes on
into those tiers and loads what they hold, and a retracted request may park
its pages in host memory. With the hierarchical cache the tree's nodes carry their
pages' content keys, so the tiers know what the device holds (prefix order across tiers).

Pins (a request's cache_control ttl) are its collaborator's, scheduler/kv_pins.py: with a
host tier to move down to, a pinned page is evicted last and only downwards; without one,
its node stays locked on the device until the TTL ends.

Invariant: allocator free + cache total + every request's owned pages == pool.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

from radixrt.cache import MatchResult, NoPrefixCache, Node, PageAllocator, PrefixCache, RadixCache
from radixrt.cache.eviction import EvictionOrder
from radixrt.cache.tier_index import namespace_id, page_keys
from radixrt.messages import KVMove, Retain
from radixrt.namespace import CacheNamespace
from radixrt.retention import drop_plan
from radixrt.scheduler.kv_tiers import SELECTIVE_HITS, KVTiers, no_tier_stats
from radixrt.scheduler.kv_handle import TierLoad
from radixrt.scheduler.kv_pins import KVPins
from radixrt.scheduler.req import Req

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
        self.pins = KVPins(self.cache, tiers, self.keyed, page_size, capacity,
                           int(pinned_namespace_fraction * capacity), self._keys)
        if tiers is not None:
            tiers.on_device = self.cache.by_key.__contains__
        self.copy_src: list[int] = []  # slot copies for the next batch (copy-on-write)
        self.copy_dst: list[int] = []

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    def set_quotas(self, quota: Callable[[str], int | None] | None) -> None:
        """Tenants' quotas in device pages (scheduler/tenants.py; None: no quotas): the cache evicts
        an over-quota tenant's pages first, and pins count toward the quota."""
        if quota is not None:
            self.cache.set_quotas(quota)
            self.pins.quota = quota

    def cached_pages_by_owner(self) -> dict[str, int]:
        return self.cache.pages_by_owner()

    @property
    def available(self) -> int:
        """Pages that can be had now: free, or freed by evicting unpinned cache leaves."""
        return self.allocator.num_free + self.cache.evictable_pages

    # -- admission -------------------------------------------------------------------

    def match(self, r: Req) -> MatchResult:
        """r's reusable prefix in the tree. Nothing is pinned: the result is good until the
        next allocation, so pass it to admit() before allocating anything."""
        m = self.cache.match_prefix(r.tokens(0, r.match_limit), r.namespace)
        if self.keyed and self.tiers.write_policy == "write_through_selective":
            node = m.node
            while node.parent is not None:  # the nodes this hit took to the threshold go to host now
                if node.stamp.hits == SELECTIVE_HITS and node.keys:
                    self.tiers.offload(node.keys, node.pages, _last_key(node.parent), node.start, node.stamp.hits,
                                       write=True)
                node = node.parent
        return m

    def prefix_len(self, r: Req) -> int:
        """Tokens of r the cache holds now, in the tree or below it, without touching LRU order (for the policy)."""
        m = self.cache.match_prefix(r.tokens(0, r.match_limit), r.namespace, touch=False)
        below = self._tier_keys(r, len(m.pages))
        if below:
            return (len(m.pages) + self.tiers.hits(below)) * self.page_size
        return m.matched_len

    def _tier_keys(self, r: Req, start: int) -> list[str]:
        """Content keys of r's full pages from page `start` up to its match limit; [] without a host tier cache."""
        full = r.match_limit // self.page_size
        if not self.keyed or full <= start:
            return []
        return self._keys(r, full)[start:]

    def _keys(self, r: Req, full: int) -> list[str]:
        """Content keys of r's first `full` pages (worked out once per request, extended as it grows)."""
        kv = r.kv
        if len(kv.page_keys) < full or (kv.page_keys and not kv.page_keys[0].startswith(namespace_id(r.namespace.encoded))):
            kv.page_keys = page_keys(r.tokens(0, full * self.page_size), self.page_size, r.namespace.encoded,
                                     kv.page_keys)
        return kv.page_keys[:full]

    def admit(self, r: Req, m: MatchResult, n: int, reserve: int) -> bool:
        """Start r's page table from its match m (fresh from match(r)) if the pages to run its
        next n tokens fit with `reserve` pages kept back; False, changing nothing, if not.
        The match is pinned, goes on into the lower tiers as far as the pages allow (loading
        replaces computing), and a partial page's slots are copied into a page of r's own."""
        self.cache.lock(m.node)  # first: the match's own pages are not available to it
        if math.ceil((m.matched_len + n) / self.page_size) - len(m.pages) + reserve > self.available:
            self.cache.unlock(m.node)
            return False
        full = self._extend_from_tiers(r, m, self.available - reserve)
        kv = r.kv
        kv.reset(list(full.pages), len(full.pages) * self.page_size)
        kv.tree_pages, kv.lock_node = len(full.pages), full.node
        if full.partial_len:
            (own,) = self.alloc(1)
            ps = self.page_size
            self.copy_src += range(full.partial_page * ps, full.partial_page * ps + full.partial_len)
            self.copy_dst += range(own * ps, own * ps + full.partial_len)
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
            freed = self.cache.evict(short, sink=self._offload if self.tiers is not None else None)
            logger.debug("evicted %d cached pages", len(freed))
            self.allocator.free(freed)
        return self.allocator.alloc(n)

    def retain(self, r: Req, n: int) -> Retain | None:
        """Before r runs n more tokens: drop what its retention policy lets go (None: nothing)."""
        p = drop_plan.plan(r.kv, r.retention, n)
        if p is None:
            return None
        kv, ps = r.kv, self.page_size
        if p.copies:  # allocated while the cache still pins the originals: none is evicted from under its copy
            for j, own in zip(p.copies, self.alloc(len(p.copies))):
                self.copy_src += range(kv.pages[j] * ps, (kv.pages[j] + 1) * ps)
                self.copy_dst += range(own * ps, (own + 1) * ps)
                kv.pages[j] = own
        self.allocator.free(p.freed)
        if kv.dropped == 0:  # the first drop: every page is r's own from now on, and r pins no cache node
            if kv.lock_node is not None:
                self.cache.unlock(kv.lock_node)
            kv.tree_pages, kv.dup_pages, kv.lock_node = 0, [], None
        return drop_plan.rewrite(kv, r.retention, p, ps)

    def add_mass(self, r: Req, mass: list[float]) -> None:
        """The worker's per-page attention mass of r's last step (aligned with its page table), for its policy's drops."""
        drop_plan.add_mass(r.kv, mass)

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

    def _offload(self, leaf: Node) -> None:
        """An evicted leaf's full pages go down a tier (a partial leaf is only dropped)."""
        if len(leaf.keys) == len(leaf.pages):
            self.tiers.offload(leaf.keys, leaf.pages, _last_key(leaf.parent), leaf.start, leaf.stamp.hits)

    def _extend_from_tiers(self, r: Req, m: MatchResult, max_pages: int) -> MatchResult:
        """Go on from a locked tree match into the lower tiers: load (up to max_pages of) the
        pages they hold into device pages, which join the tree (pinned, as m was). m is consumed."""
        ps, start = self.page_size, len(m.pages)
        r.kv.loaded = TierLoad()
        keys = self._tier_keys(r, start)
        n = min(self.tiers.hits(keys), max_pages) if keys else 0
        if n:  # load only as far as loading is faster than recomputing (tier_costs.py)
            n = self.tiers.costs.pages_to_load(self.tiers.sources(keys[:n]), start, ps)
        if n == 0:
            return m
        self.tiers.touch(keys[:n])
        pages = self.alloc(n)
        n = self.tiers.hits(keys[:n])  # allocating may have evicted some from a host tier with no disk below
        self.allocator.free(pages[n:])
        if n == 0:
            return m
        r.kv.loaded = self.tiers.load(keys[:n], pages[:n])
        res = self.cache.insert(r.tokens(0, (start + n) * ps), m.pages + pages[:n], r.namespace,
                                self._keys(r, start + n))
        self.pins.flag(res.node)
        assert res.existing_pages == start, "the tree gained pages under a locked match"
        self.allocator.free(res.released_pages)
        self.cache.lock(res.node)
        self.cache.unlock(m.node)
        return MatchResult(m.pages + pages[:n], res.node, ps)

    def swap_out(self, r: Req) -> bool:
        """Park r's KV in host memory before it is released; False if it does not fit."""
        kv = r.kv
        pages = kv.pages[: math.ceil(kv.kv_len / self.page_size)]
        slots = self.tiers.swap_out(pages) if self.tiers is not None and pages else None
        if slots is None:
            return False
        kv.swap_slots, kv.swapped_len = slots, kv.kv_len
        return True

    def swap_in_pages(self, r: Req, n: int) -> int:
        """Pages a swapped-out r needs to come back and run n more tokens."""
        return math.ceil((r.kv.swapped_len + n) / self.page_size)

    def swap_in(self, r: Req) -> None:
        """Bring a swapped-out r's KV back into fresh pages of its own."""
        kv = r.kv
        pages = self.alloc(len(kv.swap_slots))
        self.tiers.swap_in(kv.swap_slots, pages)
        kv.reset(pages, kv.swapped_len)
        kv.clear_swap()

    def drop_swap(self, r: Req) -> None:
        """A swapped-out r leaves without coming back (aborted): free its host slots."""
        self.tiers.host.release(r.kv.swap_slots)
        r.kv.clear_swap()

    def take_moves(self) -> list[KVMove]:
        return self.tiers.take_moves() if self.tiers is not None else []

    @property
    def moves_pending(self) -> bool:
        """Tier moves wait for the next step (a finished request's pages written through, say)."""
        return self.tiers is not None and bool(self.tiers.moves)

    def persist(self) -> list[KVMove]:
        """At shutdown: the moves that write every cached page to the disk tier."""
        if self.tiers is None:
            return []
        device: list[tuple[str, str | None, int, int]] = []
        for _, _, node in self.cache.sequences():  # parents first
            parent = _last_key(node.parent)
            for i, (key, page) in enumerate(zip(node.keys, node.pages)):
                device.append((key, parent, node.start + i * self.page_size, page))
                parent = key
        self.tiers.persist(device)
        return self.take_moves()

    def forget(self, pages: set[int]) -> None:
        """Device pages a failed disk load left without their KV leave the cache, with every page
        cached after them. Release the requests that read them first (a pinned one is a bug)."""
        if pages:
            self.allocator.free(self.cache.forget(pages))
            if self.tiers is not None:
                self.tiers.sweep()  # pages below only the forgotten ones reached

    def take_copies(self) -> tuple[list[int], list[int]]:
        out = (self.copy_src, self.copy_dst)
        self.copy_src, self.copy_dst = [], []
        return out

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
        keys = self._keys(r, full) if self.keyed else None
        res = self.cache.insert(r.tokens(0, n_tokens), kv.pages[:n_pages], r.namespace, keys, r.tenant)
        if keys is not None and res.existing_pages < full:  # pages new to the tree
            self.pins.flag(res.node)
            if self.tiers.write_policy == "write_through":
                self._write_through_new(r, keys, res.existing_pages, full)
        # Pages the cache already had stay ours (we still read them); the rest are now the cache's.
        if res.existing_pages > kv.tree_pages:
            kv.dup_pages += kv.pages[kv.tree_pages : res.existing_pages]
        kv.tree_pages = max(kv.tree_pages, n_pages)
        self.allocator.free(res.released_pages)
        self.cache.lock(res.node)
        if kv.lock_node is not None:
            self.cache.unlock(kv.lock_node)
        kv.lock_node = res.node

    def _write_through_new(self, r: Req, keys: list[str], first: int, full: int) -> None:
        """Pages first..full-1 of r just entered the tree: copy them to host memory (write_through)."""
        self.tiers.offload(keys[first:full], r.kv.pages[first:full], keys[first - 1] if first else None,
                           first * self.page_size, self.cache.by_key[keys[first]].stamp.hits, write=True)

    def flush(self) -> None:
        """Forget every cached page on the device and in host memory, and every pin (the disk tier is
        persistent storage: it stays, as it would across a restart, but for pages only those reached)."""
        self.pins.clear()
        self.allocator.free(self.cache.reset())
        if self.tiers is not None:
            self.tiers.clear_host()

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


def _last_key(node: Node | None) -> str | None:
    """The content key of node's last page (None: a root, or a node without keys)."""
    return node.keys[-1] if node is not None and node.keys else None
