"""KVTiers: the scheduler's side of the KV tiers below the device pool.

Host memory holds pages by content key (radixrt/cache/tier_index.py), LRU; the
disk tier below it likewise. The flow, as in a CPU cache hierarchy:

  device leaf evicted -> offload: its full pages go to host (already there: touched)
  host full           -> its LRU page spills to disk (disk full: disk's LRU is dropped)
  a match that stops in the tree -> hits(): how many next pages host/disk hold;
                         load(): copy them into fresh device pages (host keeps its copy)
  swap_out / swap_in  -> a retracted request's pages to reserved host slots and back
  persist             -> at shutdown, everything not yet on disk is written there
  drop_namespace      -> every page of one namespace leaves host memory and disk (its files go)
  disk_failed         -> the worker could not write or read some page files: they leave
                         the disk index (a miss, recomputed); a failing disk tier turns off

Every key names its namespace (tier_index.page_keys), on disk too, so a namespace's
pages are found without a tree. Page files a previous version named otherwise are
removed at start (_adopt_disk): their keys can never equal this version's.

Each decision appends a KVMove; the worker runs them in the same order before the
next forward, so ordering hazards (a host slot spilled, then reused) resolve as
they do here. Plain Python; the worker owns the bytes (radixrt/worker/kv_tiers.py).
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from radixrt.cache.tier_index import TierIndex, is_page_key
from radixrt.messages import DiskFaults, KVMove, MoveKind, disk_page_key, disk_page_name
from radixrt.namespace import CacheNamespace
from radixrt.scheduler.kv_handle import TierLoad

logger = logging.getLogger(__name__)


def tier_counters() -> dict[str, int]:
    """The tiers' counters, all 0: pages moved per kind, pages loaded back, disk errors."""
    return {**{f"pages_{k.value}": 0 for k in MoveKind}, "host_hit_pages": 0, "disk_hit_pages": 0, "disk_tier_errors": 0}


def no_tier_stats() -> dict[str, int]:
    """KVTiers.stats() of a server without lower tiers: every figure 0."""
    return {"host_pages": 0, "host_cached_pages": 0, "host_swap_pages": 0, "disk_pages": 0, "disk_cached_pages": 0,
            "disk_tier_enabled": 0, **tier_counters()}


class KVTiers:
    def __init__(self, host_pages: int, cache_on_host: bool, disk_dir: str = "", disk_pages: int = 0) -> None:
        self.host = TierIndex(host_pages)
        self.cache_on_host = cache_on_host  # False: the host pool only holds swapped requests
        self.disk = TierIndex(disk_pages) if disk_dir else None
        self.disk_dir = Path(disk_dir) if disk_dir else None
        self.moves: list[KVMove] = []
        self._unwritten: set[str] = set()  # disk keys whose write is among the moves not yet taken
        self.counters = tier_counters()
        if self.disk is not None:
            self._adopt_disk(Path(disk_dir))

    def _adopt_disk(self, d: Path) -> None:
        """Pages a previous run left on disk, oldest first; beyond capacity they are dropped. Files
        whose names are not this version's page keys (an older key format, from before keys named
        their namespace) are removed on every rank: no request could ever hit them."""
        keys = [disk_page_key(f.name) for f in _page_files(d)]
        stale = [key for key in keys if not is_page_key(key)]
        if stale:
            logger.warning("removing %d page files of an older key format from the disk KV tier in %s; "
                           "their tokens are recomputed", len(stale), d)
            self._emit(MoveKind.DROP, keys=stale)
        for key in filter(is_page_key, keys):
            slot = self.disk.take_free()
            if slot is None:
                old, slot = self.disk.pop_lru()
                self._emit(MoveKind.DROP, keys=[old])
            self.disk.put(key, slot)

    def switch_disk(self, disk_dir: str, disk_pages: int) -> None:
        """New weights: the disk tier is now the directory of their fingerprint, with the pages a
        previous run under those weights left there ("": the workers have no disk tier now). The
        old directory is not touched (moves written to it were taken before the switch)."""
        assert not self.moves, "moves for the old disk directory are still pending"
        if not disk_dir:
            self.disk = self.disk_dir = None
            return
        self.disk = TierIndex(disk_pages)
        self.disk_dir = Path(disk_dir)
        self._adopt_disk(self.disk_dir)

    def disk_failed(self, faults: DiskFaults) -> None:
        """The workers could not write or read these pages' files (or the tier is off now): they
        are no longer on disk. Whatever file is left of them goes (on every rank)."""
        self.counters["disk_tier_errors"] += faults.errors
        if self.disk is None:
            return
        if faults.disabled:
            self.disk = self.disk_dir = None  # the worker logged why
            return
        lost = [key for key in dict.fromkeys(faults.lost_keys) if key in self.disk]
        for key in lost:
            self.disk.discard(key)
        if lost:
            self._emit(MoveKind.DROP, keys=lost)

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

    # -- pages going down -----------------------------------------------------

    def offload(self, keys: list[str], device_pages: list[int]) -> None:
        """Device pages about to be freed: keep their KV in host memory."""
        if not self.cache_on_host:
            return
        for key, page in zip(keys, device_pages):
            if key in self.host:
                self.host.get(key)
                continue
            slot = self._host_slot()
            if slot is None:  # every host slot is reserved by a swapped request
                return
            self.host.put(key, slot)
            self._emit(MoveKind.D2H, [page], [slot])

    def _host_slot(self) -> int | None:
        """A free host slot, spilling the least recently used cached page to disk if needed."""
        slot = self.host.take_free()
        if slot is None and len(self.host):
            key, slot = self.host.pop_lru()
            self._to_disk(key, MoveKind.H2DISK, slot)
        return slot

    def _to_disk(self, key: str, kind: MoveKind, src: int) -> None:
        if self.disk is None or self.disk.capacity == 0:
            return
        if key in self.disk:
            self.disk.get(key)
            return
        slot = self.disk.take_free()
        if slot is None:
            old, slot = self.disk.pop_lru()
            self._emit(MoveKind.DROP, keys=[old])
        self.disk.put(key, slot)
        self._unwritten.add(key)
        self._emit(kind, [src], keys=[key])

    # -- pages coming back ----------------------------------------------------

    def hits(self, keys: list[str]) -> int:
        """How many of keys, from the first, a lower tier holds."""
        n = 0
        for key in keys:
            if key not in self.host and not self._on_disk(key):
                break
            n += 1
        return n

    def _on_disk(self, key: str) -> bool:
        """key is in the disk index and its file is there (or about to be written); a file
        removed behind our back leaves the index, and its tokens are recomputed."""
        if self.disk is None or key not in self.disk:
            return False
        if key in self._unwritten or _exists(self.disk_dir / disk_page_name(key)):
            return True
        self.disk.discard(key)
        return False

    def touch(self, keys: list[str]) -> None:
        """Make keys most recently used (so allocating their device pages does not spill them first)."""
        for key in keys:
            (self.host if key in self.host else self.disk).get(key)

    def load(self, keys: list[str], device_pages: list[int]) -> TierLoad:
        """Copy keys' pages (all held: see hits) into device_pages; returns how many came from where."""
        host = disk = 0
        for key, page in zip(keys, device_pages):
            if key in self.host:
                self._emit(MoveKind.H2D, [self.host.get(key)], [page])
                self.counters["host_hit_pages"] += 1
                host += 1
            else:
                self.disk.get(key)
                self._emit(MoveKind.DISK2D, [], [page], [key])
                self.counters["disk_hit_pages"] += 1
                disk += 1
        return TierLoad(host, disk)

    # -- preemption by swapping -------------------------------------------------

    def swap_out(self, device_pages: list[int]) -> list[int] | None:
        """Reserve host slots for a retracted request's pages and copy them there; None if they do not fit."""
        if self.host.num_free + len(self.host) < len(device_pages):
            return None
        slots = [self._host_slot() for _ in device_pages]
        self._emit(MoveKind.D2H, device_pages, slots)
        return slots

    def swap_in(self, slots: list[int], device_pages: list[int]) -> None:
        self._emit(MoveKind.H2D, slots, device_pages)
        self.host.release(slots)

    def drop_namespace(self, namespace: CacheNamespace) -> int:
        """Forget every page of namespace in host memory and on disk (its files are removed on
        every rank); returns how many. Slots reserved by swapped requests stay theirs."""
        encoded = namespace.encoded
        host = self.host.keys_of(encoded)
        for key in host:
            self.host.discard(key)
        disk = self.disk.keys_of(encoded) if self.disk is not None else []
        for key in disk:
            self.disk.discard(key)
        if disk:
            self._emit(MoveKind.DROP, keys=disk)
        return len(host) + len(disk)

    def clear_host(self) -> None:
        """Forget the pages cached in host memory (slots reserved by swapped requests stay theirs)."""
        for key in self.host.keys():
            self.host.discard(key)

    # -- shutdown -------------------------------------------------------------------

    def persist(self, device: list[tuple[str, int]]) -> None:
        """Write what the device pool (key, page pairs) and host memory cache to disk."""
        if self.disk is None:
            return
        for key, page in device:
            self._to_disk(key, MoveKind.D2DISK, page)
        for key in self.host.keys():
            self._to_disk(key, MoveKind.H2DISK, self.host.get(key))

    def stats(self) -> dict[str, int]:
        return {
            "host_pages": self.host.capacity,
            "host_cached_pages": len(self.host),
            "host_swap_pages": self.host.capacity - self.host.num_free - len(self.host),
            "disk_pages": self.disk.capacity if self.disk is not None else 0,
            "disk_cached_pages": len(self.disk) if self.disk is not None else 0,
            "disk_tier_enabled": int(self.disk is not None),
            **self.counters,
        }


def _page_files(d: Path) -> list[Path]:
    """Rank 0's page files in d (they stand for all ranks'), oldest first, after removing the
    temporary files of writes a crash cut short. A directory that cannot be read holds none."""
    found: list[tuple[float, Path]] = []
    try:
        for f in d.glob(disk_page_name("*")):
            with contextlib.suppress(FileNotFoundError):  # removed while listed
                found.append((f.stat().st_mtime, f))
        for tmp in d.glob("*.tmp*"):
            tmp.unlink(missing_ok=True)
    except OSError as e:
        logger.warning("cannot read the disk KV tier's directory %s: %s", d, e)
    return [f for _, f in sorted(found)]


def _exists(path: Path) -> bool:
    """Whether path is there; one that cannot be looked at (permissions, I/O) is not."""
    try:
        return path.exists()
    except OSError:
        return False
