"""KVTiers: the scheduler's side of the KV tiers below the device pool.

Host memory holds pages by content key (radixrt/cache/tier_index.py); the disk tier below
it likewise. The flow, as in a CPU cache hierarchy:

  device node inserted -> write_through: its full pages are copied to host now
                          (write_through_selective: once its node is hit twice; write_back: never)
  device leaf evicted -> offload: its full pages go to host (already there: touched)
  host full           -> its first victim spills to disk (disk full: disk's first victim is dropped)
  a match that stops in the tree -> hits(): how many next pages host/disk hold;
                         load(): copy them into fresh device pages (host keeps its copy)
  swap_out / swap_in  -> a retracted request's pages to reserved host slots and back
  persist             -> at shutdown, everything not yet on disk is written there
  drop_namespace      -> every page of one namespace leaves host memory and disk (its files go)
  disk failed         -> the worker could not write or read some page files: they leave
                         the disk index (a miss, recomputed); a failing disk tier turns off

It composes two halves: host_tier.HostTier (host slots: offload, spills, swap) and
disk_tier.DiskTier (the tier below host: its index's lifecycle, and writing to it), with the
log of moves and counters they share (tier_common.TierLog). What spans every tier lives here:
prefix order, and bringing pages back.

Prefix order holds in every tier: a page is a victim only when its tier holds none of its
children, and a page that leaves the last tier holding it (device, host and disk) takes every
page after it in its sequence with it, wherever those are (cascade). So no tier ever holds an
*unreachable* page: one whose earlier page is held nowhere, which no request could ever read
again. `unreachable()` counts them anyway (the leak checks assert 0). Pinned pages (KVMemory's
pins) are victims only after every unpinned one, and then only where that loses nothing: they
spill to disk, or give up a copy another tier holds too. So they are never dropped while the
pin budget (at most what host and disk hold) is kept.

Each decision appends a KVMove (TierLog); the worker runs them in the same order before the
next forward. Plain Python; the worker owns the bytes (radixrt/worker/kv_tiers.py).
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from radixrt.cache.eviction import EvictionOrder
from radixrt.cache.tier_index import TierIndex
from radixrt.cache.tier_links import TierLinks
from radixrt.messages import KVMove, MoveKind
from radixrt.namespace import CacheNamespace
from radixrt.scheduler.disk_tier import DiskTier
from radixrt.scheduler.host_tier import HostTier
from radixrt.scheduler.kv_handle import TierLoad
from radixrt.scheduler.tier_common import TierLog, tier_counters
from radixrt.scheduler.tier_costs import TierCosts
from radixrt.settings.hicache import MooncakeSettings

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
SELECTIVE_HITS = 2  # write_through_selective: a node is written to host when a request reads it the second time


def no_tier_stats() -> dict[str, int]:
    """KVTiers.stats() of a server without lower tiers: every figure 0."""
    return {"host_pages": 0, "host_cached_pages": 0, "host_swap_pages": 0, "disk_pages": 0, "disk_cached_pages": 0,
            "disk_tier_enabled": 0, "unreachable_pages": 0, **tier_counters()}


class KVTiers:
    def __init__(self, host_pages: int, cache_on_host: bool, disk_dir: str = "", disk_pages: int = 0,
                 page_size: int = 1, order: EvictionOrder | None = None, write_policy: str = "write_back",
                 costs: TierCosts | None = None, store: MooncakeSettings | None = None) -> None:
        """store: the tier below host memory is this Mooncake Store's (None: disk_dir's directory)."""
        assert write_policy in WRITE_POLICIES, write_policy
        self.costs = costs if costs is not None else TierCosts()  # load or recompute (tier_costs.py)
        self.page_size = page_size
        self._order = order or EvictionOrder()
        self.host = TierIndex(host_pages, self._new_order())
        self.cache_on_host = cache_on_host  # False: the host pool only holds swapped requests
        self.write_policy = write_policy if cache_on_host else "write_back"
        self.store = store
        self.on_device: Callable[[str], bool] = lambda key: False  # KVMemory: whether the device tree holds key's page
        self.pinned: Collection[str] = set()  # KVMemory's pinned keys (the same set object)
        self.leaving: set[str] = set()  # keys of the device leaf being evicted (offload)
        self.links = TierLinks(lambda: [t for t in (self.host, self.disk) if t is not None])
        self.log = TierLog()
        self.disk_tier = DiskTier(disk_dir, disk_pages, page_size, store, self.host, self._new_order, self.log,
                                  self.links, self)
        self.host_tier = HostTier(self.host, cache_on_host, page_size, self.disk_tier, self.log, self.links, self)
        self.disk_tier.open(disk_dir, disk_pages)

    def _new_order(self) -> EvictionOrder:
        """Each tier keeps its own policy state (the cost policy's inflation), by one policy."""
        return EvictionOrder(self._order.policy, self._order.cost)

    @property
    def disk(self) -> TierIndex | None:
        """The disk tier's index (None: there is no disk tier now)."""
        return self.disk_tier.index

    def take_moves(self) -> list[KVMove]:
        return self.log.take()

    # -- prefix order (the links: cache/tier_links.py) --------------------------------

    def held(self, key: str | None) -> bool:
        """key's page is somewhere (None, a sequence's start, always is)."""
        return key is None or self.kept_on_device(key) or self.links.held(key)

    def kept_on_device(self, key: str) -> bool:
        """The device holds key's page and keeps it (not a page of the leaf being evicted)."""
        return key not in self.leaving and self.on_device(key)

    def cascade(self, keys: list[str]) -> None:
        """Those of keys held nowhere now take every page after them in their sequences along."""
        below = self.links.after([k for k in keys if not self.held(k)])
        if below:
            self.log.counters["cascade_dropped_pages"] += len(below)
            self.drop(below, cascaded=True)

    def drop(self, keys: list[str], only_disk: bool = False, cascaded: bool = False, purge: bool = False) -> None:
        """keys leave the disk (their files go) and, unless only_disk, host memory; then whatever
        they were the last holders of goes after them. A shared store's pages leave only the index
        (other servers may read them; the store evicts on its own) unless purge (a namespace
        forgotten, a page that failed to read)."""
        if not only_disk:
            self.host_tier.discard(keys)
        self.disk_tier.discard(keys, purge)
        if not cascaded:
            self.cascade(keys)

    def unreachable(self) -> list[str]:
        """Pages held in host or on disk whose earlier pages are not all held somewhere (0 by design)."""
        return self.links.unreachable(self.kept_on_device)

    def sweep(self) -> int:
        """Drop every unreachable page (after the device lost pages at once: a flush, a forget);
        returns how many."""
        lost = self.unreachable()
        if lost:
            self.log.counters["cascade_dropped_pages"] += len(lost)
            self.drop(lost, cascaded=True)
        return len(lost)

    # -- pages going down -----------------------------------------------------

    def offload(self, keys: list[str], device_pages: list[int], parent: str | None, start: int, hits: int = 0,
                write: bool = False) -> None:
        """Device pages (keys[i] in device_pages[i]; parent: the key before keys[0], start: its
        first token's position, hits: the device's count) go to host memory: their node is evicted
        (write False: the pages are freed right after, and a key kept nowhere takes the pages after it
        along), or written through (write True: the device keeps them)."""
        if not write:
            self.leaving = set(keys)
        try:
            self.host_tier.offload(keys, device_pages, parent, start, hits, write)
        finally:
            self.leaving = set()

    # -- pages coming back ----------------------------------------------------

    def hits(self, keys: list[str]) -> int:
        """How many of keys, from the first, a lower tier holds (a shared store: whoever put them)."""
        self.disk_tier.prepare(keys)
        n = 0
        for key in keys:
            if key not in self.host and not self.disk_tier.holds(key):
                break
            n += 1
        return n

    def sources(self, keys: list[str]) -> list[MoveKind]:
        """How each of keys (all held: see hits) would come back: H2D, or DISK2D."""
        return [MoveKind.H2D if key in self.host else MoveKind.DISK2D for key in keys]

    def touch(self, keys: list[str]) -> None:
        """Make keys recently used (so allocating their device pages does not spill them first)."""
        for key in keys:
            if key in self.host:
                self.host.get(key)
            elif key in self.disk:  # else another server's page in a shared store
                self.disk.get(key)

    def load(self, keys: list[str], device_pages: list[int]) -> TierLoad:
        """Copy keys' pages (all held: see hits) into device_pages; returns how many came from where."""
        host = disk = 0
        for key, page in zip(keys, device_pages):
            if key in self.host:
                self.log.emit(MoveKind.H2D, [self.host.get(key, hit=True)], [page])
                host += 1
            else:
                if key in self.disk:  # else another server's page in a shared store
                    self.disk.get(key, hit=True)
                self.log.emit(MoveKind.DISK2D, [], [page], [key])
                disk += 1
        self.log.counters["host_hit_pages"] += host
        self.log.counters["disk_hit_pages"] += disk
        return TierLoad(host, disk)

    def set_pinned(self, key: str, pinned: bool) -> None:
        """KVMemory pinned or unpinned key (its pinned set already says so): reorder it in each tier."""
        self.host.set_pinned(key, pinned)
        if self.disk is not None:
            self.disk.set_pinned(key, pinned)

    def drop_namespace(self, namespace: CacheNamespace) -> int:
        """Forget every page of namespace in host memory and on disk (its files are removed on
        every rank); returns how many. Slots reserved by swapped requests stay theirs."""
        encoded = namespace.encoded
        keys = set(self.host.keys_of(encoded)) | set(self.disk.keys_of(encoded) if self.disk is not None else [])
        self.drop(list(keys), cascaded=True, purge=True)
        return len(keys)

    def stats(self) -> dict[str, int]:
        return {
            "host_pages": self.host.capacity,
            "host_cached_pages": len(self.host),
            "host_swap_pages": self.host.capacity - self.host.num_free - len(self.host),
            "disk_pages": self.disk.capacity if self.disk is not None else 0,
            "disk_cached_pages": len(self.disk) if self.disk is not None else 0,
            "disk_tier_enabled": int(self.disk is not None),
            "unreachable_pages": len(self.unreachable()),
            **self.log.counters,
        }
