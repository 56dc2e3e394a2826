"""DiskTier: the tier below host memory, the disk half of KVTiers (kv_tiers.py).

It owns the index of what the tier holds (a TierIndex of content keys, None while there is no
tier: none configured, or one that failed) and its view of the storage (FileView of a directory,
or StoreView of a Mooncake Store that other servers share: disk_files.py), and their lifecycle:
opened at start with what a previous run left there (adopted in prefix order), switched to another
directory on new weights, emptied when the workers report failed pages, turned off when the tier
fails, and opened again when a store answers again. And writing pages to it: a host victim
spilling, a shared store getting each cached page at once, everything at shutdown (persist).

Every key names its namespace and its parent (tier_index.page_keys), on disk too, so a
namespace's pages are found without a tree and the pages a previous run left on disk come back
in prefix order (_adopt); files of another key format are removed at start.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from radixrt.cache.eviction import EvictionOrder
from radixrt.cache.tier_index import TierIndex, adoption_order, is_page_key
from radixrt.cache.tier_links import TierLinks
from radixrt.messages import DiskFaults, MoveKind
from radixrt.scheduler.disk_files import FileView, StoreView
from radixrt.scheduler.tier_common import PrefixOrder, TierLog
from radixrt.settings.hicache import MooncakeSettings

logger = logging.getLogger(__name__)


class DiskTier:
    def __init__(self, disk_dir: str, disk_pages: int, page_size: int, store: MooncakeSettings | None,
                 host: TierIndex, new_order: Callable[[], EvictionOrder], log: TierLog, links: TierLinks,
                 order: PrefixOrder) -> None:
        """host: the host tier's index (a disk victim another tier holds too loses nothing);
        new_order: a fresh eviction order for each index opened. Nothing is open until open()."""
        self.page_size, self.store, self.host = page_size, store, host  # store None: a directory's tier
        self._new_order, self.log, self.links, self.order = new_order, log, links, order
        self._spec = (disk_dir, disk_pages)  # what a store that answers again is indexed as
        self.index: TierIndex | None = None
        self.view: FileView | StoreView | None = None

    @property
    def shared(self) -> bool:
        """Whether other servers read and write this tier too (a Mooncake Store)."""
        return self.view is not None and self.view.shared

    def open(self, disk_dir: str, disk_pages: int) -> None:
        """An empty index of the tier ("": none), then what a previous run left there."""
        if not disk_dir:
            return
        self.index = TierIndex(disk_pages, self._new_order())
        self.view = StoreView(self.store, disk_dir) if self.store is not None else FileView(Path(disk_dir))
        self._adopt(disk_dir)

    def _adopt(self, d: str) -> None:
        """Pages a previous run left on disk, in prefix order from each sequence's first page, as far
        as capacity goes; the rest are dropped. Files whose names are not this version's page keys (an
        older key format) or whose earlier pages are not there (nothing could reach them) are removed
        on every rank: no request could ever hit them."""
        keys = self.view.adoptable()
        stale = [key for key in keys if not is_page_key(key)]
        if stale:
            logger.warning("removing %d page files of an older key format from the disk KV tier in %s; "
                           "their tokens are recomputed", len(stale), d)
            self.log.emit(MoveKind.DROP, keys=stale)
        for key, parent, depth in adoption_order([key for key in keys if is_page_key(key)]):
            slot = self.index.take_free()
            if slot is None:
                break
            self.index.put(key, slot, parent, depth * self.page_size, self.page_size)
            self.links.entered(key, parent)
        left = [key for key in keys if is_page_key(key) and key not in self.index]
        if left:
            logger.info("disk KV tier in %s: %d page files past its capacity or without their earlier pages "
                        "are removed", d, len(left))
            self.log.emit(MoveKind.DROP, keys=left)

    def switch(self, disk_dir: str, disk_pages: int) -> None:
        """New weights: the tier is now the directory of their fingerprint, with the pages a
        previous run under those weights left there ("": the workers have no disk tier now). The
        old directory is not touched (moves written to it were taken before the switch)."""
        assert not self.log.moves, "moves for the old disk directory are still pending"
        self._forget_index()
        self._spec = (disk_dir, disk_pages)
        self.open(disk_dir, disk_pages)

    def failed(self, faults: DiskFaults) -> None:
        """The workers could not write or read these pages' files (or the tier is off now): they
        are no longer on disk, nor is any page after them that nothing else holds. Whatever file is
        left of them goes (on every rank)."""
        self.log.counters["disk_tier_errors"] += faults.errors
        if self.index is not None and faults.disabled:  # the worker logged why
            self._forget_index()
            self.order.sweep()
        elif self.index is not None:
            lost = list(dict.fromkeys(faults.lost_keys))
            indexed = [key for key in lost if key in self.index]
            self.order.drop(indexed, only_disk=True, purge=True)
            if self.shared:  # another server's page that failed to read is gone for everyone too
                self.view.forget(lost)
                self.log.emit(MoveKind.DROP, keys=[key for key in lost if key not in indexed])
        if faults.rejoined and self.index is None:  # a store that answers again: empty, found as asked
            self.open(*self._spec)

    def _forget_index(self) -> None:
        """The whole index goes, without moves (a new directory, or a tier turned off): its pages
        are unlinked once the index no longer counts them as held."""
        old, self.index, self.view = self.index, None, None
        for key in old.keys() if old is not None else []:
            self.links.left(key, old.parent(key))

    def discard(self, keys: list[str], purge: bool) -> None:
        """Those of keys on disk leave it (their files go). A shared store's pages leave only the
        index (other servers may read them; the store evicts on its own) unless purge."""
        on_disk = [key for key in keys if self.index is not None and key in self.index]
        for key in on_disk:
            parent = self.index.parent(key)
            self.index.discard(key)
            self.links.left(key, parent)
        if on_disk and (purge or not self.shared):
            self.log.emit(MoveKind.DROP, keys=on_disk)

    # -- pages going down -----------------------------------------------------

    def can_take(self) -> bool:
        """The disk has a free slot, or a page to give up for a new one (see _victim)."""
        return self.index is not None and (self.index.num_free > 0 or self._victim() is not None)

    def _victim(self) -> str | None:
        """The disk's first victim: unpinned, else a pinned page host memory or the device holds too."""
        return self.index.victim(lambda k: k in self.host or self.order.kept_on_device(k))

    def write(self, key: str, parent: str | None, start: int, kind: MoveKind, src: int, hits: int = 0) -> bool:
        """Write key's page (from src) to disk unless it is there; False if the disk cannot hold it. (A
        parent leaving the device with an offload counts as held: it is being put below now, and what
        it fails to reach is dropped when the offload ends.)"""
        if self.index is None or self.index.capacity == 0:
            return False
        if key in self.index:
            self.index.get(key)
            return True
        slot = self.index.take_free()
        if slot is None:
            slot = self._free_victim_slot(parent)
            if slot is None:
                return False
        self.index.put(key, slot, parent, start, self.page_size, hits, key in self.order.pinned)
        self.links.entered(key, parent)
        self.log.unwritten.add(key)
        self.log.emit(kind, [src], keys=[key])
        return True

    def _free_victim_slot(self, parent: str | None) -> int | None:
        """The first victim's slot, for a page after parent; None where there is no victim, or the
        victim was that page's own earlier page (nothing could reach it now)."""
        victim = self._victim()
        if victim is None:
            return None
        vparent = self.index.parent(victim)
        slot = self.index.pop(victim)
        if not self.shared:
            self.log.emit(MoveKind.DROP, keys=[victim])
        self.links.left(victim, vparent)
        self.order.cascade([victim])
        if not self.order.held(parent) and parent not in self.order.leaving:
            self.index.release([slot])
            return None
        return slot

    def persist(self, device: list[tuple[str, str | None, int, int]]) -> None:
        """Write what the device pool (key, parent, start, page: parents first) and host memory cache to disk."""
        if self.index is None or self.shared:  # a store's pages went there as they were cached
            return
        for key, parent, start, page in device:
            self.write(key, parent, start, MoveKind.D2DISK, page)
        for key in self.host.keys():
            self.write(key, self.host.parent(key), self.host.place(key)[0], MoveKind.H2DISK, self.host.get(key))

    # -- pages coming back ----------------------------------------------------

    def prepare(self, keys: list[str]) -> None:
        """keys are about to be asked for (a store looks them up at once)."""
        if self.view is not None:
            self.view.prepare(keys)

    def holds(self, key: str) -> bool:
        """A request could load key's page from here (a shared store: whoever put it)."""
        return self._indexed(key) or (self.shared and self.view.has(key))

    def _indexed(self, key: str) -> bool:
        """key is in the index and its file is there (or about to be written); a file removed
        behind our back leaves the index (with what only it reached), and its tokens are recomputed."""
        if self.index is None or key not in self.index:
            return False
        if key in self.log.unwritten or self.view.has(key):
            return True
        self.order.drop([key], only_disk=True)
        return False
