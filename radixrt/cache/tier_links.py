"""TierLinks: which of the pages the lower tiers hold follow which, across host and disk.

KVTiers (scheduler/kv_tiers.py) keeps every tier in prefix order; this is the part of it that
makes no moves: the links from a page to the pages after it that host memory or the disk holds,
so a page leaving the last tier holding it can take them along (after), and where a held page's
sequence is broken (unreachable). Plain Python.
"""

from __future__ import annotations

from typing import Callable

from radixrt.cache.tier_index import TierIndex


class TierLinks:
    def __init__(self, tiers: Callable[[], list[TierIndex]]) -> None:
        """tiers(): the lower tiers now (host, and disk while there is one)."""
        self._tiers = tiers
        self._children: dict[str | None, set[str]] = {}  # parent key -> its children held below

    def held(self, key: str) -> bool:
        """A lower tier holds key's page."""
        return any(key in t for t in self._tiers())

    def parent(self, key: str) -> str | None:
        return next(t.parent(key) for t in self._tiers() if key in t)

    def entered(self, key: str, parent: str | None) -> None:
        """key was put in a lower tier (call after the put)."""
        self._children.setdefault(parent, set()).add(key)

    def left(self, key: str, parent: str | None) -> None:
        """key left a lower tier (call after the pop): unlinked once no lower tier holds it."""
        if not self.held(key):
            kids = self._children.get(parent)
            if kids is not None:
                kids.discard(key)
                if not kids:
                    del self._children[parent]

    def after(self, keys: list[str]) -> list[str]:
        """Every held page after keys in their sequences, parents before children."""
        out, stack = [], [c for k in keys for c in self._children.get(k, ())]
        while stack:
            key = stack.pop()
            out.append(key)
            stack += self._children.get(key, ())
        return out

    def unreachable(self, on_device: Callable[[str], bool]) -> list[str]:
        """Held pages an earlier page of whose sequence is held nowhere (on_device: the device's pages)."""
        ok: dict[str, bool] = {}

        def reachable(key: str) -> bool:
            path = []
            while key not in ok:
                parent = self.parent(key)
                path.append(key)
                if parent is None or on_device(parent):
                    good = True
                    break
                if not self.held(parent):
                    good = False
                    break
                key = parent
            else:
                good = ok[key]
            for k in path:
                ok[k] = good
            return good

        keys = {key for t in self._tiers() for key in t.keys()}
        return [key for key in keys if not reachable(key)]
