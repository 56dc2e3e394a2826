"""The lower tiers' bookkeeping: content keys of KV pages, and an LRU index per tier.

A page below the device pool (in host memory or on disk) is found by its
*content key*: a hash chained over its namespace and every token from the
start of the sequence through the end of the page, so equal keys mean equal
KV (same model, same prefix). Keys need no tree: they survive a restart (the
disk tier's files are named by them) and a page evicted from one branch of
the radix tree is found again from any request with the same prefix.

TierIndex maps keys to slots of one tier (host page ids; on disk the slot is
unused) in least-recently-used order. Plain Python, no tensors.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

KEY_BYTES = 16


def page_keys(tokens: list[int], page_size: int, namespace: str | None, known: list[str] | None = None) -> list[str]:
    """Keys of every full page of tokens; `known` (keys of a prefix, from an earlier call) is extended, not redone."""
    keys = list(known or [])
    prev = bytes.fromhex(keys[-1]) if keys else hashlib.blake2b((namespace or "").encode(), digest_size=KEY_BYTES).digest()
    for start in range(len(keys) * page_size, len(tokens) // page_size * page_size, page_size):
        h = hashlib.blake2b(prev, digest_size=KEY_BYTES)
        h.update(array("i", tokens[start : start + page_size]).tobytes())
        prev = h.digest()
        keys.append(prev.hex())
    return keys


class TierIndex:
    """key -> slot for one tier of `capacity` pages, LRU first. Slots not holding a key
    are free, or reserved (taken out by reserve() until release())."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._slots: OrderedDict[str, int] = OrderedDict()
        self._free = list(range(capacity - 1, -1, -1))

    def __contains__(self, key: str) -> bool:
        return key in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def keys(self) -> list[str]:
        return list(self._slots)

    def get(self, key: str) -> int:
        """key's slot, now most recently used. KeyError if absent."""
        self._slots.move_to_end(key)
        return self._slots[key]

    def pop_lru(self) -> tuple[str, int]:
        return self._slots.popitem(last=False)

    def take_free(self) -> int | None:
        return self._free.pop() if self._free else None

    def put(self, key: str, slot: int) -> None:
        """Record key at slot (a slot from take_free or pop_lru), most recently used."""
        assert key not in self._slots
        self._slots[key] = slot

    def discard(self, key: str) -> None:
        slot = self._slots.pop(key, None)
        if slot is not None:
            self._free.append(slot)

    def release(self, slots: list[int]) -> None:
        """Return reserved slots to the free list."""
        self._free.extend(slots)
        assert len(self._free) + len(self._slots) <= self.capacity, "a tier slot was released twice"
