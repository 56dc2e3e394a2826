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
  disk_failed         -> the worker could not write or read some page files: they leave
                         the disk index (a miss, recomputed); a failing disk tier turns off

Prefix order holds in every tier: a page is a victim only when its tier holds none of its
children, and a page that leaves the last tier holding it (device, host and disk) takes every
page after it in its sequence with it, wherever those are (_cascade). So no tier ever holds an
*unreachable* page: one whose earlier page is held nowhere, which no request could ever read
again. `unreachable()` counts them anyway (the leak checks assert 0). Pinned pages (KVMemory's
pins) are victims only after every unpinned one, and then only where that loses nothing: they
spill to disk, or give up a copy another tier holds too. So they are never dropped while the
pin budget (at most what host and disk hold) is kept.

Every key names its namespace and its parent (tier_index.page_keys), on disk too, so a
namespace's pages are found without a tree and the pages a previous run left on disk come back
in prefix order (_adopt_disk); files of another key format are removed at start.

Each decision appends a KVMove; the worker runs them in the same order before the
next forward, so ordering hazards (a host slot spilled, then reused) resolve as
they do here. Plain Python; the worker owns the bytes (radixrt/worker/kv_tiers.py).
"""

from __future__ import annotations

import logging
from pathlib import Path

from radixrt.cache.eviction import EvictionOrder
from radixrt.cache.tier_index import TierIndex, adoption_order, is_page_key
from radixrt.cache.tier_links import TierLinks
from radixrt.settings.hicache import MooncakeSettings
from radixrt.messages import DiskFaults, KVMove, MoveKind
from radixrt.scheduler.disk_files import FileView, StoreView
from radixrt.namespace import CacheNamespace
from radixrt.scheduler.tier_costs import TierCosts
from radixrt.scheduler.kv_handle import TierLoad

logger = logging.getLogger(__name__)

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
SELECTIVE_HITS = 2  # write_through_selective: a node is written to host when a request reads it the second time


def tier_counters() -> dict[str, int]:
    """The tiers' counters, all 0: pages moved per kind, pages loaded back, pages dropped with an
    earlier page of theirs (cascade), pinned pages that had to be dropped, disk errors."""
    return {**{f"pages_{k.value}": 0 for k in MoveKind}, "host_hit_pages": 0, "disk_hit_pages": 0,
            "cascade_dropped_pages": 0, "pinned_dropped_pages": 0, "disk_tier_errors": 0}


def no_tier_stats() -> dict[str, int]:
    """KVTiers.stats() of a server without lower tiers: every figure 0."""
    return {"host_pages": 0, "host_cached_pages": 0, "host_swap_pages": 0, "disk_pages": 0, "disk_cached_pages": 0,
            "disk_tier_enabled": 0, "unreachable_pages": 0, **tier_counters()}


class KVTiers:
    def __init__(self, host_pages: int, cache_on_host: bool, disk_dir: str = "", disk_pages: int = 0,
                 page_size: int = 1, order: EvictionOrder | None = None, write_policy: str = "write_back",
                 costs: TierCosts | None = None, store: MooncakeSettings | None = None) -> None:
        assert write_policy in WRITE_POLICIES, write_policy
        self.costs = costs if costs is not None else TierCosts()  # load or recompute (tier_costs.py)
        self.page_size = page_size
        self._order = order or EvictionOrder()
        self.host = TierIndex(host_pages, self._new_order())
        self.cache_on_host = cache_on_host  # False: the host pool only holds swapped requests
        self.write_policy = write_policy if cache_on_host else "write_back"
        self.store = store  # the tier below host memory is this Mooncake Store's (None: a directory's)
        self._disk_spec = (disk_dir, disk_pages)  # what a store that answers again is indexed as
        self.disk: TierIndex | None = None
        self.view: FileView | StoreView | None = None
        self.on_device = lambda key: False  # KVMemory: whether the device tree holds key's page
        self.pinned: set[str] = set()  # KVMemory's pinned keys (the same set object)
        self.links = TierLinks(lambda: [t for t in (self.host, self.disk) if t is not None])
        self._leaving: set[str] = set()  # keys of the device leaf being evicted (offload)
        self.moves: list[KVMove] = []
        self._unwritten: set[str] = set()  # disk keys whose write is among the moves not yet taken
        self.counters = tier_counters()
        self._open_disk(disk_dir, disk_pages)

    def _new_order(self) -> EvictionOrder:
        """Each tier keeps its own policy state (the cost policy's inflation), by one policy."""
        return EvictionOrder(self._order.policy, self._order.cost)

    def _open_disk(self, disk_dir: str, disk_pages: int) -> None:
        """An empty index of the tier below host memory ("": none), then what a previous run left there."""
        if not disk_dir:
            return
        self.disk = TierIndex(disk_pages, self._new_order())
        self.view = StoreView(self.store, disk_dir) if self.store is not None else FileView(Path(disk_dir))
        self._adopt_disk(disk_dir)

    @property
    def shared(self) -> bool:
        """Whether other servers read and write the tier below host memory too (a Mooncake Store)."""
        return self.view is not None and self.view.shared

    def _adopt_disk(self, d: str) -> None:
        """Pages a previous run left on disk, in prefix order from each sequence's first page, as far
        as capacity goes; the rest are dropped. Files whose names are not this version's page keys (an
        older key format) or whose earlier pages are not there (nothing could reach them) are removed
        on every rank: no request could ever hit them."""
        keys = self.view.adoptable()
        stale = [key for key in keys if not is_page_key(key)]
        if stale:
            logger.warning("removing %d page files of an older key format from the disk KV tier in %s; "
                           "their tokens are recomputed", len(stale), d)
            self._emit(MoveKind.DROP, keys=stale)
        for key, parent, depth in adoption_order([key for key in keys if is_page_key(key)]):
            slot = self.disk.take_free()
            if slot is None:
                break
            self.disk.put(key, slot, parent, depth * self.page_size, self.page_size)
            self.links.entered(key, parent)
        left = [key for key in keys if is_page_key(key) and key not in self.disk]
        if left:
            logger.info("disk KV tier in %s: %d page files past its capacity or without their earlier pages "
                        "are removed", d, len(left))
            self._emit(MoveKind.DROP, keys=left)

    def switch_disk(self, disk_dir: str, disk_pages: int) -> None:
        """New weights: the disk tier is now the directory of their fingerprint, with the pages a
        previous run under those weights left there ("": the workers have no disk tier now). The
        old directory is not touched (moves written to it were taken before the switch)."""
        assert not self.moves, "moves for the old disk directory are still pending"
        self._forget_disk_index()
        self._disk_spec = (disk_dir, disk_pages)
        self._open_disk(disk_dir, disk_pages)

    def disk_failed(self, faults: DiskFaults) -> None:
        """The workers could not write or read these pages' files (or the tier is off now): they
        are no longer on disk, nor is any page after them that nothing else holds. Whatever file is
        left of them goes (on every rank)."""
        self.counters["disk_tier_errors"] += faults.errors
        if self.disk is not None and faults.disabled:  # the worker logged why
            self._forget_disk_index()
            self.sweep()
        elif self.disk is not None:
            lost = list(dict.fromkeys(faults.lost_keys))
            indexed = [key for key in lost if key in self.disk]
            self._drop(indexed, only_disk=True, purge=True)
            if self.shared:  # another server's page that failed to read is gone for everyone too
                self.view.forget(lost)
                self._emit(MoveKind.DROP, keys=[key for key in lost if key not in indexed])
        if faults.rejoined and self.disk is None:  # a store that answers again: empty, found as asked
            self._open_disk(*self._disk_spec)

    def _forget_disk_index(self) -> None:
        """The whole disk index goes, without moves (a new directory, or a tier turned off): its
        pages are unlinked once the index no longer counts them as held."""
        old, self.disk, self.view = self.disk, None, None
        for key in old.keys() if old is not None else []:
            self.links.left(key, old.parent(key))

    def take_moves(self) -> list[KVMove]:
        out, self.moves = self.moves, []
        self._unwritten.clear()
        return out

    def _emit(self, kind: MoveKind, src: list[int] = (), dst: list[int] = (), keys: list[str] = ()) -> None:
        last = self.moves[-1] if self.moves else None
        if last is not None and last.kind is kind:
            last.src += src
            last.dst += dst
            last.keys += keys
        else:
            self.moves.append(KVMove(kind, list(src), list(dst), list(keys)))
        self.counters[f"pages_{kind.value}"] += max(len(src), len(keys))

    # -- prefix order (the links: cache/tier_links.py) --------------------------------

    def _held(self, key: str | None) -> bool:
        """key's page is somewhere (None, a sequence's start, always is)."""
        return key is None or self._on_device(key) or self.links.held(key)

    def _on_device(self, key: str) -> bool:
        """The device holds key's page and keeps it (not a page of the leaf being evicted)."""
        return key not in self._leaving and self.on_device(key)

    def _cascade(self, keys: list[str]) -> None:
        """Those of keys held nowhere now take every page after them in their sequences along."""
        below = self.links.after([k for k in keys if not self._held(k)])
        if below:
            self.counters["cascade_dropped_pages"] += len(below)
            self._drop(below, cascaded=True)

    def _drop(self, keys: list[str], only_disk: bool = False, cascaded: bool = False, purge: bool = False) -> None:
        """keys leave the disk (their files go) and, unless only_disk, host memory; then whatever
        they were the last holders of goes after them. A shared store's pages leave only the index
        (other servers may read them; the store evicts on its own) unless purge (a namespace
        forgotten, a page that failed to read)."""
        on_disk = [key for key in keys if self.disk is not None and key in self.disk]
        for key in keys if not only_disk else []:
            if key in self.host:
                parent = self.host.parent(key)
                self.host.discard(key)
                self.links.left(key, parent)
        for key in on_disk:
            parent = self.disk.parent(key)
            self.disk.discard(key)
            self.links.left(key, parent)
        if on_disk and (purge or not self.shared):
            self._emit(MoveKind.DROP, keys=on_disk)
        if not cascaded:
            self._cascade(keys)

    def unreachable(self) -> list[str]:
        """Pages held in host or on disk whose earlier pages are not all held somewhere (0 by design)."""
        return self.links.unreachable(self._on_device)

    def sweep(self) -> int:
        """Drop every unreachable page (after the device lost pages at once: a flush, a forget);
        returns how many."""
        lost = self.unreachable()
        if lost:
            self.counters["cascade_dropped_pages"] += len(lost)
            self._drop(lost, cascaded=True)
        return len(lost)

    # -- pages going down -----------------------------------------------------

    def offload(self, keys: list[str], device_pages: list[int], parent: str | None, start: int, hits: int = 0,
                write: bool = False) -> None:
        """Device pages (keys[i] in device_pages[i]; parent: the key before keys[0], start: its
        first token's position, hits: the device's count) go to host memory: their node is evicted
        (write False: the pages are freed right after, and a key kept nowhere takes the pages after it
        along), or written through (write True: the device keeps them)."""
        if not write:
            self._leaving = set(keys)
        try:
            self._offload(keys, device_pages, parent, start, hits, write)
        finally:
            self._leaving = set()

    def _offload(self, keys: list[str], device_pages: list[int], parent: str | None, start: int, hits: int,
                 write: bool) -> None:
        if not self.cache_on_host:
            if not write:
                self._cascade(keys)
            return
        for i, (key, page) in enumerate(zip(keys, device_pages)):
            if key in self.host:
                self.host.get(key)
            elif self._held(parent):  # else nothing could reach it
                slot = self._host_slot()
                if slot is None:  # every host slot is reserved by a swapped request, or pinned
                    if self.links.held(key):  # on disk already
                        parent = key
                        continue
                    self.counters["pinned_dropped_pages"] += (not write) * sum(k in self.pinned for k in keys[i:])
                    break
                self.host.put(key, slot, parent, start + i * self.page_size, self.page_size, hits, key in self.pinned)
                self.links.entered(key, parent)
                self._emit(MoveKind.D2H, [page], [slot])
                if self.shared:  # on to the store at once, for the other servers
                    self._to_disk(key, parent, start + i * self.page_size, MoveKind.H2DISK, slot, hits)
            parent = key
        if not write:
            self._cascade(keys)

    def _host_slot(self) -> int | None:
        """A free host slot, else the first victim's: it spills to disk, or is dropped where the disk
        cannot take it. A pinned victim goes only where that loses nothing (it spills, or another
        tier holds it too); else None."""
        slot = self.host.take_free()
        if slot is not None:
            return slot
        spills = self._disk_can_take()
        key = self.host.victim(lambda k: spills or self._on_device(k) or (self.disk is not None and k in self.disk))
        if key is None:
            return None
        parent, (start, hits) = self.host.parent(key), self.host.place(key)
        slot = self.host.pop(key)
        kept = self._to_disk(key, parent, start, MoveKind.H2DISK, slot, hits)
        self.links.left(key, parent)
        if not kept:
            self._cascade([key])
        return slot

    def _disk_can_take(self) -> bool:
        """The disk has a free slot, or a page to give up for a new one (see _disk_victim)."""
        return self.disk is not None and (self.disk.num_free > 0 or self._disk_victim() is not None)

    def _disk_victim(self) -> str | None:
        """The disk's first victim: unpinned, else a pinned page host memory or the device holds too."""
        return self.disk.victim(lambda k: k in self.host or self._on_device(k))

    def _to_disk(self, key: str, parent: str | None, start: int, kind: MoveKind, src: int, hits: int = 0) -> bool:
        """Write key's page (from src) to disk unless it is there; False if the disk cannot hold it. (A
        parent leaving the device with an offload counts as held: it is being put below now, and what
        it fails to reach is dropped when the offload ends.)"""
        if self.disk is None or self.disk.capacity == 0:
            return False
        if key in self.disk:
            self.disk.get(key)
            return True
        slot = self.disk.take_free()
        if slot is None:
            victim = self._disk_victim()
            if victim is None:
                return False
            vparent = self.disk.parent(victim)
            slot = self.disk.pop(victim)
            if not self.shared:
                self._emit(MoveKind.DROP, keys=[victim])
            self.links.left(victim, vparent)
            self._cascade([victim])
            if not self._held(parent) and parent not in self._leaving:  # the victim was key's own earlier page
                self.disk.release([slot])
                return False
        self.disk.put(key, slot, parent, start, self.page_size, hits, key in self.pinned)
        self.links.entered(key, parent)
        self._unwritten.add(key)
        self._emit(kind, [src], keys=[key])
        return True

    # -- pages coming back ----------------------------------------------------

    def hits(self, keys: list[str]) -> int:
        """How many of keys, from the first, a lower tier holds (a shared store: whoever put them)."""
        if self.view is not None:
            self.view.prepare(keys)
        n = 0
        for key in keys:
            if key not in self.host and not self._on_disk(key) and not (self.shared and self.view.has(key)):
                break
            n += 1
        return n

    def sources(self, keys: list[str]) -> list[MoveKind]:
        """How each of keys (all held: see hits) would come back: H2D, or DISK2D."""
        return [MoveKind.H2D if key in self.host else MoveKind.DISK2D for key in keys]

    def _on_disk(self, key: str) -> bool:
        """key is in the disk index and its file is there (or about to be written); a file
        removed behind our back leaves the index (with what only it reached), and its tokens are recomputed."""
        if self.disk is None or key not in self.disk:
            return False
        if key in self._unwritten or self.view.has(key):
            return True
        self._drop([key], only_disk=True)
        return False

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
                self._emit(MoveKind.H2D, [self.host.get(key, hit=True)], [page])
                host += 1
            else:
                if key in self.disk:  # else another server's page in a shared store
                    self.disk.get(key, hit=True)
                self._emit(MoveKind.DISK2D, [], [page], [key])
                disk += 1
        self.counters["host_hit_pages"] += host
        self.counters["disk_hit_pages"] += disk
        return TierLoad(host, disk)

    def set_pinned(self, key: str, pinned: bool) -> None:
        """KVMemory pinned or unpinned key (its pinned set already says so): reorder it in each tier."""
        self.host.set_pinned(key, pinned)
        if self.disk is not None:
            self.disk.set_pinned(key, pinned)

    # -- preemption by swapping -------------------------------------------------

    def swap_out(self, device_pages: list[int]) -> list[int] | None:
        """Reserve host slots for a retracted request's pages and copy them there; None if they do not fit."""
        if self.host.num_free + len(self.host) < len(device_pages):
            return None
        slots = []
        for _ in device_pages:
            slot = self._host_slot()
            if slot is None:  # the rest is pinned with no disk below
                self.host.release(slots)
                return None
            slots.append(slot)
        self._emit(MoveKind.D2H, device_pages, slots)
        return slots

    def swap_in(self, slots: list[int], device_pages: list[int]) -> None:
        self._emit(MoveKind.H2D, slots, device_pages)
        self.host.release(slots)

    def drop_namespace(self, namespace: CacheNamespace) -> int:
        """Forget every page of namespace in host memory and on disk (its files are removed on
        every rank); returns how many. Slots reserved by swapped requests stay theirs."""
        encoded = namespace.encoded
        keys = set(self.host.keys_of(encoded)) | set(self.disk.keys_of(encoded) if self.disk is not None else [])
        self._drop(list(keys), cascaded=True, purge=True)
        return len(keys)

    def clear_host(self) -> None:
        """Forget the pages cached in host memory (slots reserved by swapped requests stay theirs),
        and every page on disk only they reached."""
        for key in self.host.keys():
            parent = self.host.parent(key)
            self.host.discard(key)
            self.links.left(key, parent)
        self.sweep()

    # -- shutdown -------------------------------------------------------------------

    def persist(self, device: list[tuple[str, str | None, int, int]]) -> None:
        """Write what the device pool (key, parent, start, page: parents first) and host memory cache to disk."""
        if self.disk is None or self.shared:  # a store's pages went there as they were cached
            return
        for key, parent, start, page in device:
            self._to_disk(key, parent, start, MoveKind.D2DISK, page)
        for key in self.host.keys():
            self._to_disk(key, self.host.parent(key), self.host.place(key)[0], MoveKind.H2DISK, self.host.get(key))

    def stats(self) -> dict[str, int]:
        return {
            "host_pages": self.host.capacity,
            "host_cached_pages": len(self.host),
            "host_swap_pages": self.host.capacity - self.host.num_free - len(self.host),
            "disk_pages": self.disk.capacity if self.disk is not None else 0,
            "disk_cached_pages": len(self.disk) if self.disk is not None else 0,
            "disk_tier_enabled": int(self.disk is not None),
            "unreachable_pages": len(self.unreachable()),
            **self.counters,
        }
