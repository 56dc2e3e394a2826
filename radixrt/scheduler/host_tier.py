"""HostTier: host memory below the device pool, the host half of KVTiers (kv_tiers.py).

It owns the host slots: which are cached pages (the index, by content key), which are reserved by
swapped-out requests, and which are free. Pages come here from the device (offload: an evicted
leaf, or a write-through copy) and leave for the disk tier when a slot is needed (a spill: the
first victim's page is written below, or dropped where the disk cannot take it). A retracted
request's pages may be parked in reserved slots (swap_out) and come back (swap_in).
"""

from __future__ import annotations

from radixrt.cache.tier_index import TierIndex
from radixrt.cache.tier_links import TierLinks
from radixrt.messages import MoveKind
from radixrt.scheduler.disk_tier import DiskTier
from radixrt.scheduler.tier_common import PrefixOrder, TierLog


class HostTier:
    def __init__(self, index: TierIndex, cache_on_host: bool, page_size: int, disk: DiskTier, log: TierLog,
                 links: TierLinks, order: PrefixOrder) -> None:
        """cache_on_host False: the host slots only hold swapped requests (no pages are cached here)."""
        self.index, self.cache_on_host, self.page_size = index, cache_on_host, page_size
        self.disk, self.log, self.links, self.order = disk, log, links, order

    def offload(self, keys: list[str], device_pages: list[int], parent: str | None, start: int, hits: int,
                write: bool) -> None:
        """Device pages go to host memory (see KVTiers.offload); write False: their node is evicted,
        and a key kept nowhere takes the pages after it along."""
        if not self.cache_on_host:
            if not write:
                self.order.cascade(keys)
            return
        for i, (key, page) in enumerate(zip(keys, device_pages)):
            if key in self.index:
                self.index.get(key)
            elif self.order.held(parent):  # else nothing could reach it
                slot = self.take_slot()
                if slot is None:  # every host slot is reserved by a swapped request, or pinned
                    if self.links.held(key):  # on disk already
                        parent = key
                        continue
                    self.log.counters["pinned_dropped_pages"] += (not write) * sum(k in self.order.pinned
                                                                                   for k in keys[i:])
                    break
                self._put(key, slot, parent, start + i * self.page_size, hits, page)
            parent = key
        if not write:
            self.order.cascade(keys)

    def _put(self, key: str, slot: int, parent: str | None, start: int, hits: int, page: int) -> None:
        """Device page `page` (key's) is copied into host slot `slot`."""
        self.index.put(key, slot, parent, start, self.page_size, hits, key in self.order.pinned)
        self.links.entered(key, parent)
        self.log.emit(MoveKind.D2H, [page], [slot])
        if self.disk.shared:  # on to the store at once, for the other servers
            self.disk.write(key, parent, start, MoveKind.H2DISK, slot, hits)

    def take_slot(self) -> int | None:
        """A free host slot, else the first victim's: it spills to disk, or is dropped where the disk
        cannot take it. A pinned victim goes only where that loses nothing (it spills, or another
        tier holds it too); else None."""
        slot = self.index.take_free()
        if slot is not None:
            return slot
        spills, disk = self.disk.can_take(), self.disk.index
        key = self.index.victim(lambda k: spills or self.order.kept_on_device(k) or (disk is not None and k in disk))
        if key is None:
            return None
        parent, (start, hits) = self.index.parent(key), self.index.place(key)
        slot = self.index.pop(key)
        kept = self.disk.write(key, parent, start, MoveKind.H2DISK, slot, hits)
        self.links.left(key, parent)
        if not kept:
            self.order.cascade([key])
        return slot

    def discard(self, keys: list[str]) -> None:
        """Those of keys cached here leave host memory (no move: their slots are simply free)."""
        for key in keys:
            if key in self.index:
                parent = self.index.parent(key)
                self.index.discard(key)
                self.links.left(key, parent)

    def clear(self) -> None:
        """Forget the pages cached in host memory (slots reserved by swapped requests stay theirs),
        and every page on disk only they reached."""
        self.discard(self.index.keys())
        self.order.sweep()

    # -- preemption by swapping -------------------------------------------------

    def swap_out(self, device_pages: list[int]) -> list[int] | None:
        """Reserve host slots for a retracted request's pages and copy them there; None if they do not fit."""
        if self.index.num_free + len(self.index) < len(device_pages):
            return None
        slots = []
        for _ in device_pages:
            slot = self.take_slot()
            if slot is None:  # the rest is pinned with no disk below
                self.index.release(slots)
                return None
            slots.append(slot)
        self.log.emit(MoveKind.D2H, device_pages, slots)
        return slots

    def swap_in(self, slots: list[int], device_pages: list[int]) -> None:
        """A swapped request's pages come back into device_pages; its reserved slots are free again."""
        self.log.emit(MoveKind.H2D, slots, device_pages)
        self.index.release(slots)
