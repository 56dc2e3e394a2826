"""TierBridge: what passes between KVMemory's device prefix cache and the tiers below it (KVTiers).

With the hierarchical cache the tree's nodes carry their pages' content keys (content_keys), so
the tiers know what the device holds (prefix order across tiers). Down: an evicted cache leaf's
full pages go to host memory (offload_leaf), and new tree pages are copied there by the write
policy (write_through at insert, write_through_selective at a node's second hit). Up: a match
that stops in the tree goes on into the tiers and loads what they hold (extend). And the moves
this makes, for the worker (take_moves, persist at shutdown), and the device pages a failed disk
load left without KV (forget). Without tiers every step here is a no-op.
"""

from __future__ import annotations

from collections.abc import Callable

from radixrt.cache import MatchResult, Node, PageAllocator, PrefixCache
from radixrt.cache.tier_index import namespace_id, page_keys
from radixrt.messages import KVMove
from radixrt.scheduler.kv_handle import TierLoad
from radixrt.scheduler.kv_pins import KVPins
from radixrt.scheduler.kv_tiers import SELECTIVE_HITS, KVTiers
from radixrt.scheduler.req import Req


def content_keys(r: Req, full: int, page_size: int) -> list[str]:
    """Content keys of r's first `full` pages (worked out once per request, extended as it grows,
    and again when r's namespace changed: the memo is r's KVHandle's page_keys)."""
    kv = r.kv
    if len(kv.page_keys) < full or (kv.page_keys and not kv.page_keys[0].startswith(namespace_id(r.namespace.encoded))):
        kv.page_keys = page_keys(r.tokens(0, full * page_size), page_size, r.namespace.encoded, kv.page_keys)
    return kv.page_keys[:full]


def last_key(node: Node | None) -> str | None:
    """The content key of node's last page (None: a root, or a node without keys)."""
    return node.keys[-1] if node is not None and node.keys else None


class TierBridge:
    def __init__(self, cache: PrefixCache, allocator: PageAllocator, tiers: KVTiers | None, keyed: bool,
                 page_size: int, pins: KVPins, alloc: Callable[[int], list[int]]) -> None:
        """keyed: the tree's nodes carry content keys (a host tier caches pages); alloc(n): n free
        device pages (KVMemory.alloc: evicting cache leaves, through offload_leaf, if it must)."""
        self.cache, self.allocator, self.tiers, self.keyed = cache, allocator, tiers, keyed
        self.page_size, self.pins, self.alloc = page_size, pins, alloc

    def tier_keys(self, r: Req, start: int) -> list[str]:
        """Content keys of r's full pages from page `start` up to its match limit; [] without a host tier cache."""
        full = r.match_limit // self.page_size
        if not self.keyed or full <= start:
            return []
        return content_keys(r, full, self.page_size)[start:]

    # -- down -------------------------------------------------------------------------

    def hit(self, node: Node) -> None:
        """A match ended at node: under write_through_selective, the nodes this hit took to the
        threshold go to host now."""
        if not self.keyed or self.tiers.write_policy != "write_through_selective":
            return
        while node.parent is not None:
            if node.stamp.hits == SELECTIVE_HITS and node.keys:
                self.tiers.offload(node.keys, node.pages, last_key(node.parent), node.start, node.stamp.hits,
                                   write=True)
            node = node.parent

    def offload_leaf(self, leaf: Node) -> None:
        """An evicted leaf's full pages go down a tier (a partial leaf is only dropped)."""
        if len(leaf.keys) == len(leaf.pages):
            self.tiers.offload(leaf.keys, leaf.pages, last_key(leaf.parent), leaf.start, leaf.stamp.hits)

    def write_through(self, r: Req, keys: list[str], first: int, full: int) -> None:
        """Pages first..full-1 of r just entered the tree: copy them to host memory (write_through)."""
        self.tiers.offload(keys[first:full], r.kv.pages[first:full], keys[first - 1] if first else None,
                           first * self.page_size, self.cache.by_key[keys[first]].stamp.hits, write=True)

    # -- up ---------------------------------------------------------------------------

    def extend(self, r: Req, m: MatchResult, max_pages: int) -> MatchResult:
        """Go on from a locked tree match into the lower tiers: load (up to max_pages of) the
        pages they hold into device pages, which join the tree (pinned, as m was). m is consumed."""
        ps, start = self.page_size, len(m.pages)
        r.kv.loaded = TierLoad()
        keys = self.tier_keys(r, start)
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
                                content_keys(r, start + n, ps))
        self.pins.flag(res.node)
        assert res.existing_pages == start, "the tree gained pages under a locked match"
        self.allocator.free(res.released_pages)
        self.cache.lock(res.node)
        self.cache.unlock(m.node)
        return MatchResult(m.pages + pages[:n], res.node, ps)

    def forget(self, pages: set[int]) -> None:
        """Device pages a failed disk load left without their KV leave the cache, with every page
        cached after them. Release the requests that read them first (a pinned one is a bug)."""
        if pages:
            self.allocator.free(self.cache.forget(pages))
            if self.tiers is not None:
                self.tiers.sweep()  # pages below only the forgotten ones reached

    # -- the moves, for the worker ---------------------------------------------------------

    def take_moves(self) -> list[KVMove]:
        return self.tiers.take_moves() if self.tiers is not None else []

    @property
    def moves_pending(self) -> bool:
        """Tier moves wait for the next step (a finished request's pages written through, say)."""
        return self.tiers is not None and bool(self.tiers.log.moves)

    def persist(self) -> list[KVMove]:
        """At shutdown: the moves that write every cached page to the disk tier."""
        if self.tiers is None:
            return []
        device: list[tuple[str, str | None, int, int]] = []
        for _, _, node in self.cache.sequences():  # parents first
            parent = last_key(node.parent)
            for i, (key, page) in enumerate(zip(node.keys, node.pages)):
                device.append((key, parent, node.start + i * self.page_size, page))
                parent = key
        self.tiers.disk_tier.persist(device)
        return self.take_moves()
