"""The lower tiers' bookkeeping: content keys of KV pages, and a prefix-ordered index per tier.

A page below the device pool (in host memory or on disk) is found by its
*content key*: a hash chained over its namespace and every token from the
start of the sequence through the end of the page, so equal keys mean equal
KV (same model, same namespace, same prefix). Keys need no tree: they survive a
restart (the disk tier's files are named by them) and a page evicted from one
branch of the radix tree is found again from any request with the same prefix.

The namespace comes in as its encoded bytes (the runtime's CacheNamespace.encoded:
unambiguous, so no two namespaces seed a chain alike); this module never reads
them. A key is `<namespace id>-<parent ref>-<chain hash>`:
- the namespace id (a short hash of the encoding) records which namespace each page
  belongs to, on disk too, so all the pages of one namespace can be found and dropped (keys_of);
- the parent ref is the first PARENT_REF_CHARS of the previous page's chain hash (all zeros
  for a sequence's first page), so the prefix order of pages found on disk after a restart is
  known from their names alone (parent_ref);
- the chain hash names the page.
A file name of any other shape is not a page key of this version (is_page_key): the disk tier removes it.

TierIndex maps keys to slots of one tier (host page ids; on disk the slot is unused) and keeps
them in prefix order: each key knows its parent key, and only a page of which this tier holds no
child (a leaf of the tier) is ever a victim, in the eviction policy's order (cache/eviction.py),
unpinned pages before pinned ones. Plain Python, no tensors.
"""

from __future__ import annotations

import hashlib
import itertools
import re
from array import array
from dataclasses import dataclass, field
from typing import Callable

from sortedcontainers import SortedList

from radixrt.cache.eviction import EvictionOrder, Stamp

KEY_BYTES = 16  # of the chain hash
NAMESPACE_ID_BYTES = 8  # a collision only makes keys_of name another namespace's pages too, never share them
PARENT_REF_CHARS = 16  # hex digits of the parent's chain hash in a key
ROOT_REF = "0" * PARENT_REF_CHARS  # the parent ref of a sequence's first page
_KEY_SHAPE = re.compile(f"[0-9a-f]{{{2 * NAMESPACE_ID_BYTES}}}-[0-9a-f]{{{PARENT_REF_CHARS}}}-[0-9a-f]{{{2 * KEY_BYTES}}}")


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
        prev = bytes.fromhex(chain_hash(keys[-1]))
        ref = chain_hash(keys[-1])[:PARENT_REF_CHARS]
    else:
        prev = hashlib.blake2b(namespace, digest_size=KEY_BYTES, person=b"page-chain").digest()
        ref = ROOT_REF
    for start in range(len(keys) * page_size, len(tokens) // page_size * page_size, page_size):
        h = hashlib.blake2b(prev, digest_size=KEY_BYTES)
        h.update(array("i", tokens[start : start + page_size]).tobytes())
        prev = h.digest()
        keys.append(f"{ns}-{ref}-{prev.hex()}")
        ref = keys[-1][-2 * KEY_BYTES :][:PARENT_REF_CHARS]
    return keys


def chain_hash(key: str) -> str:
    return key[-2 * KEY_BYTES :]


def parent_ref(key: str) -> str:
    """The parent ref written in key (ROOT_REF: the first page of its sequence)."""
    return key[2 * NAMESPACE_ID_BYTES + 1 : 2 * NAMESPACE_ID_BYTES + 1 + PARENT_REF_CHARS]


def parents_of(keys: list[str]) -> dict[str, str | None]:
    """Each key's parent among keys, from the refs in their names: None for a sequence's first page;
    a key whose parent is not among keys is left out (an orphan: nothing can reach it)."""
    by_ref = {(k[: 2 * NAMESPACE_ID_BYTES], chain_hash(k)[:PARENT_REF_CHARS]): k for k in keys}
    out: dict[str, str | None] = {}
    for k in keys:
        ref = parent_ref(k)
        if ref == ROOT_REF:
            out[k] = None
        elif (parent := by_ref.get((k[: 2 * NAMESPACE_ID_BYTES], ref))) is not None:
            out[k] = parent
    return out


def adoption_order(keys: list[str]) -> list[tuple[str, str | None, int]]:
    """keys (found on disk) as (key, parent, depth) in prefix order, breadth first from each
    sequence's first page; orphans, and the pages only they lead to, are left out."""
    parents = parents_of(keys)
    kids: dict[str | None, list[str]] = {}
    for key, parent in parents.items():
        kids.setdefault(parent, []).append(key)
    out, frontier, depth = [], kids.get(None, []), 0
    while frontier:
        out += [(key, parents[key], depth) for key in frontier]
        frontier, depth = [c for key in frontier for c in kids.get(key, [])], depth + 1
    return out


def is_page_key(key: str) -> bool:
    """Whether key has the shape page_keys gives (a disk file of an older version's keys has not)."""
    return _KEY_SHAPE.fullmatch(key) is not None


@dataclass(eq=False)
class _Entry:
    key: str
    slot: int
    parent: str | None
    start: int  # tokens before the page in its sequence (the cost policy prices its recompute by it)
    size: int  # tokens in the page
    stamp: Stamp = field(default_factory=Stamp)
    pinned: bool = False
    seq: int = 0  # tie-break among equal keys: earlier first


class TierIndex:
    """key -> slot for one tier of `capacity` pages, in prefix order (see the module docstring).
    Slots not holding a key are free, or reserved (taken by take_free until release())."""

    def __init__(self, capacity: int, order: EvictionOrder | None = None) -> None:
        self.capacity = capacity
        self.order = order or EvictionOrder()
        self._entries: dict[str, _Entry] = {}
        self._kids: dict[str, int] = {}  # parent key (held here or not) -> how many of its children are held here
        self._leaves = SortedList(key=lambda e: (e.pinned, self.order.key(e.stamp), e.seq))
        self._free = list(range(capacity - 1, -1, -1))
        self._clock = itertools.count(1)
        self._seq = itertools.count()

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def keys(self) -> list[str]:
        return list(self._entries)

    def keys_of(self, namespace: bytes) -> list[str]:
        """The keys held of the namespace encoded as `namespace`."""
        prefix = namespace_id(namespace) + "-"
        return [key for key in self._entries if key.startswith(prefix)]

    def parent(self, key: str) -> str | None:
        return self._entries[key].parent

    def is_leaf(self, key: str) -> bool:
        """No child of key is held here."""
        return key not in self._kids

    def get(self, key: str, hit: bool = False) -> int:
        """key's slot, now most recently used (a hit: a request reads it). KeyError if absent."""
        e = self._entries[key]
        self._restamp(e, lambda: self.order.touch(e.stamp, next(self._clock), e.start, e.size, hit))
        return e.slot

    def put(self, key: str, slot: int, parent: str | None, start: int, size: int, hits: int = 0,
            pinned: bool = False) -> None:
        """Record key at slot (a slot from take_free or pop), most recently used; parent: the key of the
        page before it in its sequence (None: the first page), start/size: its tokens' place and number,
        hits: what the tier above counted for it."""
        assert key not in self._entries
        e = _Entry(key, slot, parent, start, size, Stamp(hits=hits), pinned, seq=next(self._seq))
        self.order.touch(e.stamp, next(self._clock), start, size, hit=False)
        self._entries[key] = e
        if parent is not None:
            if parent not in self._kids and parent in self._entries:
                self._leaves.remove(self._entries[parent])
            self._kids[parent] = self._kids.get(parent, 0) + 1
        if key not in self._kids:
            self._leaves.add(e)

    def victim(self, pinned_ok: Callable[[str], bool] | bool) -> str | None:
        """The leaf to give up first: the first unpinned one in the policy's order, else the first
        pinned one that pinned_ok (True, or a test of its key) allows; None if there is none."""
        for e in self._leaves:
            if not e.pinned or pinned_ok is True or (pinned_ok and pinned_ok(e.key)):
                return e.key
        return None

    def place(self, key: str) -> tuple[int, int]:
        """key's first token's position in its sequence, and its hits."""
        e = self._entries[key]
        return e.start, e.stamp.hits

    def pop(self, key: str) -> int:
        """Take key out; returns its slot, which the caller reuses or frees. Victims are leaves; a page
        taken out before its children here (its file was lost) leaves them counted under its key."""
        e = self._entries.pop(key)
        if key not in self._kids:
            self._leaves.remove(e)
        self.order.evicted(e.stamp)
        if e.parent is not None:
            self._kids[e.parent] -= 1
            if self._kids[e.parent] == 0:
                del self._kids[e.parent]
                if e.parent in self._entries:
                    self._leaves.add(self._entries[e.parent])
        return e.slot

    def take_free(self) -> int | None:
        return self._free.pop() if self._free else None

    def discard(self, key: str) -> None:
        """Take key out, if held, and free its slot."""
        if key in self._entries:
            self._free.append(self.pop(key))

    def set_pinned(self, key: str, pinned: bool) -> None:
        e = self._entries.get(key)
        if e is not None and e.pinned != pinned:
            self._restamp(e, lambda: setattr(e, "pinned", pinned))

    def release(self, slots: list[int]) -> None:
        """Return reserved slots to the free list."""
        self._free.extend(slots)
        assert len(self._free) + len(self._entries) <= self.capacity, "a tier slot was released twice"

    def _restamp(self, e: _Entry, change: Callable[[], None]) -> None:
        # NOTE: the SortedList finds an entry by its sort key: remove it before the key changes.
        leaf = e.key not in self._kids
        if leaf:
            self._leaves.remove(e)
        change()
        if leaf:
            self._leaves.add(e)
