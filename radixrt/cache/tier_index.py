"""The lower tiers' bookkeeping: content keys of KV pages, and an LRU index per tier.

A page below the device pool (in host memory or on disk) is found by its
*content key*: a hash chained over its namespace and every token from the
start of the sequence through the end of the page, so equal keys mean equal
KV (same model, same namespace, same prefix). Keys need no tree: they survive a
restart (the disk tier's files are named by them) and a page evicted from one
branch of the radix tree is found again from any request with the same prefix.

The namespace comes in as its encoded bytes (the runtime's CacheNamespace.encoded:
unambiguous, so no two namespaces seed a chain alike); this module never reads
them. A key is `<namespace id>-<chain hash>`: the namespace id (a short hash of the
encoding) records which namespace each page belongs to, on disk too, so all the
pages of one namespace can be found and dropped (keys_of). A file name of any other
shape is not a page key of this version (is_page_key): the disk tier removes it.

TierIndex maps keys to slots of one tier (host page ids; on disk the slot is
unused) in least-recently-used order. Plain Python, no tensors.
"""

from __future__ import annotations

import hashlib
import re
from array import array
from collections import OrderedDict

KEY_BYTES = 16  # of the chain hash
NAMESPACE_ID_BYTES = 8  # a collision only makes keys_of name another namespace's pages too, never share them
_KEY_SHAPE = re.compile(f"[0-9a-f]{{{2 * NAMESPACE_ID_BYTES}}}-[0-9a-f]{{{2 * KEY_BYTES}}}")


def namespace_id(namespace: bytes) -> str:
    """The id that leads every page key of the namespace encoded as `namespace`."""
    return hashlib.blake2b(namespace, digest_size=NAMESPACE_ID_BYTES, person=b"namespace-id").hexdigest()


def page_keys(tokens: list[int], page_size: int, namespace: bytes, known: list[str] | None = None) -> list[str]:
    """Keys of every full page of tokens in the namespace encoded as `namespace`; `known` (keys of a
    prefix, from an earlier call) is extended, not redone, unless it is another namespace's (a request
    whose namespace changed: a longrope one gone long), which none of these keys can extend."""
    ns = namespace_id(namespace)
    keys = list(known) if known and known[-1].startswith(ns + "-") else []
    if keys:
        prev = bytes.fromhex(keys[-1][len(ns) + 1 :])
    else:
        prev = hashlib.blake2b(namespace, digest_size=KEY_BYTES, person=b"page-chain").digest()
    for start in range(len(keys) * page_size, len(tokens) // page_size * page_size, page_size):
        h = hashlib.blake2b(prev, digest_size=KEY_BYTES)
        h.update(array("i", tokens[start : start + page_size]).tobytes())
        prev = h.digest()
        keys.append(f"{ns}-{prev.hex()}")
    return keys


def is_page_key(key: str) -> bool:
    """Whether key has the shape page_keys gives (a disk file of an older version's keys has not)."""
    return _KEY_SHAPE.fullmatch(key) is not None


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

    def keys_of(self, namespace: bytes) -> list[str]:
        """The keys held of the namespace encoded as `namespace`."""
        prefix = namespace_id(namespace) + "-"
        return [key for key in self._slots if key.startswith(prefix)]

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
