"""What the two halves of KVTiers (host_tier.py, disk_tier.py) share with the whole (kv_tiers.py).

TierLog: the moves the tiers decided and the worker has not run yet, in order, and the counters
of everything they did (pages moved per kind, loaded back, dropped).
PrefixOrder: what a half asks of the whole. Prefix order spans every tier (a page is reachable
while its earlier pages are held anywhere: device, host or disk), so it lives with KVTiers, not in
either half; the halves reach it through this protocol, which KVTiers implements.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Protocol

from radixrt.messages import KVMove, MoveKind


def tier_counters() -> dict[str, int]:
    """The tiers' counters, all 0: pages moved per kind, pages loaded back, pages dropped with an
    earlier page of theirs (cascade), pinned pages that had to be dropped, disk errors."""
    return {**{f"pages_{k.value}": 0 for k in MoveKind}, "host_hit_pages": 0, "disk_hit_pages": 0,
            "cascade_dropped_pages": 0, "pinned_dropped_pages": 0, "disk_tier_errors": 0}


class TierLog:
    """Each decision appends a KVMove; the worker runs them in the same order before the next
    forward, so ordering hazards (a host slot spilled, then reused) resolve as they do here."""

    def __init__(self) -> None:
        self.moves: list[KVMove] = []
        self.unwritten: set[str] = set()  # disk keys whose write is among the moves not yet taken
        self.counters = tier_counters()

    def emit(self, kind: MoveKind, src: list[int] = (), dst: list[int] = (), keys: list[str] = ()) -> None:
        """Append a move (merged into the last one when it is of the same kind), and count its pages."""
        last = self.moves[-1] if self.moves else None
        if last is not None and last.kind is kind:
            last.src += src
            last.dst += dst
            last.keys += keys
        else:
            self.moves.append(KVMove(kind, list(src), list(dst), list(keys)))
        self.counters[f"pages_{kind.value}"] += max(len(src), len(keys))

    def take(self) -> list[KVMove]:
        """The moves so far, for the worker's next step; the log starts empty again."""
        out, self.moves = self.moves, []
        self.unwritten.clear()
        return out


class PrefixOrder(Protocol):
    """KVTiers, as its halves see it. pinned: KVPins' pinned keys (victims only after every unpinned
    page); leaving: the keys of the device leaf being evicted (an offload in progress)."""

    pinned: Collection[str]
    leaving: set[str]

    def held(self, key: str | None) -> bool:
        """key's page is somewhere (None, a sequence's start, always is)."""
        ...

    def kept_on_device(self, key: str) -> bool:
        """The device holds key's page and keeps it (not a page of the leaf being evicted)."""
        ...

    def cascade(self, keys: list[str]) -> None:
        """Those of keys held nowhere now take every page after them in their sequences along."""
        ...

    def drop(self, keys: list[str], only_disk: bool = False, cascaded: bool = False, purge: bool = False) -> None:
        """keys leave the disk and, unless only_disk, host memory; then what only they reached."""
        ...

    def sweep(self) -> int:
        """Drop every unreachable page; returns how many."""
        ...
