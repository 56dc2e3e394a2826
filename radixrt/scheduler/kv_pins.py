"""KVPins: requests' pins (cache_control ttl) on the scheduler's side, for KVMemory.

The budget check at arrival (refusal), the pin itself (a PinTable of content keys:
cache/pins.py), and keeping the pinned pages where KVMemory's cache and tiers hold them:
- with a host tier to move down to (`keyed`: the tree's nodes carry content keys), a node
  holding a pinned page is ordered among the last leaves to go (flag), and the tiers
  (KVTiers.pinned, the same keys) only move such pages down;
- without one, the node of a pinned prompt stays locked on the device from when its request
  leaves until the pin ends (lock_on_release, expire).
"""

from __future__ import annotations

import heapq
import itertools
from typing import Callable

from radixrt.cache import NoPrefixCache, Node, PrefixCache
from radixrt.cache.pins import PinTable
from radixrt.cache.tier_index import namespace_id
from radixrt.scheduler.kv_tiers import KVTiers
from radixrt.scheduler.req import Req


class KVPins:
    def __init__(self, cache: PrefixCache, tiers: KVTiers | None, keyed: bool, page_size: int, capacity: int,
                 namespace_capacity: int, keys: Callable[[Req, int], list[str]]) -> None:
        """keys(r, n): the content keys of r's first n pages (KVMemory's, worked out once per request)."""
        self.cache, self.tiers, self.keyed, self.page_size = cache, tiers, keyed, page_size
        self.table = PinTable(capacity, namespace_capacity)
        self.quota: Callable[[str], int | None] = lambda tenant: None  # a tenant's KV quota in pages (tenants.py)
        self._keys = keys
        self._locks: list[tuple[float, int, Node]] = []  # (until, seq, node): device locks (no host tier)
        self._seq = itertools.count()
        if tiers is not None:
            tiers.pinned = self.table.until.keys()

    def _prompt_keys(self, r: Req) -> list[str]:
        return self._keys(r, r.prompt_len // self.page_size)

    def refusal(self, r: Req) -> str | None:
        """Why r's pin passes a budget; None: it fits (or r pins nothing)."""
        if r.pin_ttl is None:
            return None
        if self.table.capacity == 0:
            return ("cache_control: this server takes no pins (--max-pinned-fraction is 0"
                    + (", or the radix cache is off)" if isinstance(self.cache, NoPrefixCache) else ")"))
        why = self.table.refusal(self._prompt_keys(r), namespace_id(r.namespace.encoded), r.tenant,
                                 self.quota(r.tenant))
        self.table.pins_refused += why is not None
        return why

    def pin(self, r: Req, now: float) -> None:
        """Pin r's prompt pages until now + its ttl (refusal said it fits), wherever they are now or
        will be. Without a host tier the pages are locked on the device when r leaves (lock_on_release)."""
        for key in self.table.pin(self._prompt_keys(r), namespace_id(r.namespace.encoded), now + r.pin_ttl,
                                  r.tenant):
            if key in self.cache.by_key:
                self.cache.set_pinned(self.cache.by_key[key], True)
            if self.tiers is not None:
                self.tiers.set_pinned(key, True)

    def flag(self, node: Node) -> None:
        """Order node (and the nodes above it) among the pinned leaves if they hold a pinned page."""
        while node.parent is not None and node.keys:
            self.cache.set_pinned(node, any(key in self.table for key in node.keys))
            node = node.parent

    def lock_on_release(self, r: Req) -> None:
        """r left and its KV is in the tree: without a host tier, its pinned prompt pages stay on the
        device, locked, until the pin ends."""
        if r.pin_ttl is None or self.keyed or not self.table.capacity:
            return
        keys = self._prompt_keys(r)
        m = self.cache.match_prefix(r.tokens(0, len(keys) * self.page_size), r.namespace, touch=False)
        if m.pages and keys:
            self.cache.lock(m.node)
            heapq.heappush(self._locks, (self.table.until.get(keys[-1], 0.0), next(self._seq), m.node))

    def expire(self, now: float) -> None:
        """Pins that ended by now: their pages are ordinary cache pages again."""
        for key in self.table.expire(now):
            if key in self.cache.by_key:
                self.flag(self.cache.by_key[key])
            if self.tiers is not None:
                self.tiers.set_pinned(key, False)
        while self._locks and self._locks[0][0] <= now:
            self.cache.unlock(heapq.heappop(self._locks)[2])

    def clear(self) -> None:
        """Every pin ends now (a flush, a weight update), its device locks with it."""
        while self._locks:
            self.cache.unlock(heapq.heappop(self._locks)[2])
        self.table.clear()
