"""Draft tokens for n-gram speculative decoding (prompt lookup): the tokens that followed the
longest suffix of a sequence where that suffix occurred before.

`SequenceLookup` searches one request's own tokens. `NgramIndex` searches every sequence the
server indexed, one trie per namespace: a proposal reads only its own namespace's trie, so
drafts (and so acceptance speed) never reveal another tenant's text. Plain Python, no tensors:
the scheduler owns both and calls `propose` once per decoding request per step.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Iterator, Sequence
from operator import attrgetter
from typing import NamedTuple

MATCH_TYPES = ("BFS", "PROB")
RECENT_SEQUENCES = 8  # per namespace: the last sequences added, whose extensions are indexed incrementally
# tracemalloc, CPython 3.11, default windows, 2,000-token random sequences over vocabularies of 2 to 32,000:
BYTES_PER_NODE = 330  # the node object, its share of children dicts, its LRU entry, its label's tuple header
BYTES_PER_TOKEN = 8  # a label's item pointer (token ints are shared with the caller's sequence)


class SequenceLookup:
    """One request's tokens (prompt, then output so far), indexed as they arrive.

    One dict maps every n-gram (n in [min_window, max_window]; lengths never collide) to the end
    of its latest occurrence. Appending a token costs max_window - min_window + 1 lookups of
    keys of at most max_window tokens, whatever the length held. Memory grows with the sequence
    (one entry per token and window length), which the request's own length bounds.
    """

    def __init__(self, min_window: int, max_window: int) -> None:
        _check_windows(min_window, max_window)
        self.min_window, self.max_window = min_window, max_window
        self._tokens: list[int] = []
        self._latest: dict[tuple[int, ...], int] = {}
        # _earlier[n - min_window]: the end of the current suffix n-gram's previous occurrence, or None
        self._earlier: list[int | None] = [None] * (max_window - min_window + 1)

    def __len__(self) -> int:
        return len(self._tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Appends `tokens`."""
        seq, latest, earlier, low = self._tokens, self._latest, self._earlier, self.min_window
        for token in tokens:
            seq.append(token)
            end, window = len(seq) - 1, tuple(seq[-self.max_window:])
            for n in range(low, self.max_window + 1):
                if n > len(window):
                    earlier[n - low] = None
                    continue
                key = window[len(window) - n:]
                earlier[n - low] = latest.get(key)  # read before the suffix itself becomes the latest
                latest[key] = end

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the most recent earlier occurrence of the longest suffix
        (max_window down to min_window tokens) that occurred before; [] when none or k <= 0."""
        return self.match(k)[1]

    def match(self, k: int) -> tuple[int, list[int]]:
        """(the length of the suffix matched, propose(k)); (0, []) when none or k <= 0."""
        if k <= 0:
            return 0, []
        for i in range(len(self._earlier) - 1, -1, -1):
            end = self._earlier[i]
            if end is not None:
                return self.min_window + i, self._tokens[end + 1:end + 1 + k]
        return 0, []


class _Node:
    """An edge of a path-compressed trie and the node below it: the node spells its ancestors'
    labels then its own. Every position along an edge has the same occurrences (edges split
    where they would differ): `count` were indexed, the latest at clock `stamp`. `last` is the
    child the latest add continued into (BFS); `best` the child with the most occurrences, ties
    to the latest (PROB)."""

    __slots__ = ("best", "children", "count", "label", "last", "parent", "stamp")

    def __init__(self, parent: _Node | None, label: tuple[int, ...], count: int, stamp: int) -> None:
        self.parent, self.label, self.count, self.stamp = parent, label, count, stamp
        self.children: dict[int, _Node] | None = None  # by the first token of the child's label; None: a leaf
        self.last: _Node | None = None
        self.best: _Node | None = None


class _Root(_Node):
    __slots__ = ("namespace",)

    def __init__(self, namespace: Hashable) -> None:
        super().__init__(None, (), 0, 0)
        self.namespace = namespace


class _Location(NamedTuple):
    path: list[_Node]  # the nodes from the root's child down to the one holding the gram's end
    offset: int  # how many tokens of path[-1]'s label the gram covers


class NgramIndex:
    """Draft tokens from every sequence added, one path-compressed trie per namespace.

    `add` inserts, from every start position, the next max_window + branch_length tokens as a
    path from the namespace's root: spelling an n-gram reaches the occurrences of it, and what
    lies below are the continuations that followed them. `propose` spells the longest suffix of
    the context that has a continuation (max_window down to min_window tokens), then follows
    `last` (BFS: the most recently added continuation; token by token, the token that followed
    the latest occurrence of the suffix plus the drafts so far) or `best` (PROB: the most
    frequent next token, ties to the most recent), for up to min(k, branch_length) tokens.

    Memory: an entry is one stored token of an edge label; `capacity` bounds them over all
    namespaces. Each touch (add or propose) moves its path's nodes to the young end of one LRU
    order, deepest first, so a node is always younger than its descendants and the oldest node
    is a leaf: eviction pops the oldest leaves until `entries <= capacity` (checked after each
    start position, so a running add overshoots by at most one path). Identical continuations
    share nodes, so re-adding a sequence costs no memory; re-adding one that extends one of the
    namespace's last RECENT_SEQUENCES walks only the start positions whose paths reach the new
    tokens (the others keep their counts and recency; once evicted, their counts are not
    restored by it).

    NOTE: proposals read only their own namespace's trie, but `capacity` is shared: heavy adds
    in one namespace can evict another's nodes (shorter or no drafts there, never foreign
    tokens), as the radix cache's shared page pool does.
    """

    def __init__(self, min_window: int = 1, max_window: int = 12, branch_length: int = 18,
                 capacity: int = 1_000_000, match_type: str = "BFS") -> None:
        _check_windows(min_window, max_window)
        for name, value in (("branch_length", branch_length), ("capacity", capacity)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if match_type not in MATCH_TYPES:
            raise ValueError(f"match_type must be one of {MATCH_TYPES}, got {match_type!r}")
        self.min_window, self.max_window, self.branch_length = min_window, max_window, branch_length
        self.capacity, self.match_type = capacity, match_type
        self._depth = max_window + branch_length  # a path: the longest n-gram and its whole branch
        self._roots: dict[Hashable, _Root] = {}
        self._recent: dict[Hashable, list[tuple[int, bytes]]] = {}  # (length, digest) of the last adds
        self._lru: OrderedDict[_Node, None] = OrderedDict()  # oldest first; roots are not in it
        self._entries = 0
        self._clock = 0

    @property
    def entries(self) -> int:
        """Tokens stored in edge labels, over all namespaces."""
        return self._entries

    @property
    def approx_bytes(self) -> int:
        """nodes * BYTES_PER_NODE + entries * BYTES_PER_TOKEN, both measured with tracemalloc
        (within 10% on 2,000-token sequences over vocabularies of 2 to 32,000 tokens)."""
        return len(self._lru) * BYTES_PER_NODE + self._entries * BYTES_PER_TOKEN

    def clear(self) -> None:
        self._roots.clear()
        self._recent.clear()
        self._lru.clear()
        self._entries = 0

    def forget(self, namespace: Hashable) -> None:
        """Drops everything `namespace` holds (no-op when it holds nothing)."""
        self._recent.pop(namespace, None)
        root = self._roots.pop(namespace, None)
        stack = list(root.children.values()) if root is not None and root.children else []
        while stack:
            node = stack.pop()
            stack.extend(node.children.values() if node.children else ())
            del self._lru[node]
            self._entries -= len(node.label)

    def add(self, namespace: Hashable, tokens: Sequence[int]) -> None:
        """Indexes `tokens` (ints below 2**63) under `namespace`: every n-gram of at most
        max_window tokens, with the branch_length tokens that followed it. One walk per start
        position; a walk creates at most two nodes (a split and a leaf)."""
        tokens = tuple(tokens)
        if not tokens:
            return
        data = array("q", tokens).tobytes()
        recent = self._recent.get(namespace, [])
        extended = _extended(recent, data)
        known = extended[0] if extended else 0  # tokens[:known] were added before
        for start in range(max(0, known - self._depth + 1), len(tokens)):
            root = self._roots.get(namespace) or self._roots.setdefault(namespace, _Root(namespace))
            self._walk(root, tokens[start:start + self._depth], known - start)
            if self._entries > self.capacity:
                self._evict()
        recent = [entry for entry in recent if entry is not extended] + [(len(tokens), _digest(data))]
        self._recent[namespace] = recent[-RECENT_SEQUENCES:]

    def propose(self, namespace: Hashable, context: Sequence[int], k: int, longer_than: int = 0) -> list[int]:
        """Up to min(k, branch_length) tokens continuing `context` (a list or tuple; only its
        last max_window tokens are read); [] when no suffix of at least min_window tokens (and
        more than `longer_than`) has a continuation in the namespace, or k <= 0."""
        root = self._roots.get(namespace)
        if k <= 0 or root is None:
            return []
        tail = tuple(context[-self.max_window:])
        for n in range(len(tail), max(self.min_window, longer_than + 1) - 1, -1):
            found = _locate(root, tail[len(tail) - n:])
            if found and (found.offset < len(found.path[-1].label) or found.path[-1].last):
                return self._follow(found, min(k, self.branch_length))
        return []

    def anchors(self, namespace: Hashable, context: Sequence[int], longer_than: int = 0) -> Iterator[tuple[int, _Location]]:
        """Every suffix `propose` would try (of the last max_window tokens of `context`, down to
        min_window tokens and more than `longer_than`) that has a continuation in the namespace,
        as (its length, where it ends), longest first and lazily: a caller that stops early
        locates no more. Touches nothing: a caller drafting from these passes the nodes it read
        to `_touch`. A location is valid until the next add, forget or clear."""
        root = self._roots.get(namespace)
        if root is None:
            return
        tail = tuple(context[-self.max_window:])
        for n in range(len(tail), max(self.min_window, longer_than + 1) - 1, -1):
            found = _locate(root, tail[len(tail) - n:])
            if found and (found.offset < len(found.path[-1].label) or found.path[-1].last):
                yield n, found

    def _follow(self, found: _Location, limit: int) -> list[int]:
        """Up to `limit` tokens past `found`, choosing children by match_type; touches the path."""
        path, node = found.path, found.path[-1]
        drafts = list(node.label[found.offset:found.offset + limit])
        prob = self.match_type == "PROB"
        while len(drafts) < limit:
            node = node.best if prob else node.last
            if node is None:
                break
            path.append(node)
            drafts.extend(node.label[:limit - len(drafts)])
        self._touch(path)
        return drafts

    def _walk(self, root: _Root, segment: tuple[int, ...], counted: int) -> None:
        """Adds one occurrence of `segment` below `root`; its first `counted` tokens were
        already counted (the old part of an extension, whose walk ended there, so an edge
        boundary lies there unless eviction removed it)."""
        self._clock += 1
        clock, node, pos, path = self._clock, root, 0, []
        while pos < len(segment):
            child = node.children.get(segment[pos]) if node.children else None
            if child is None:
                child = self._attach(node, segment[pos:])
                stop = len(child.label)
            else:
                stop = _shared(child.label, segment, pos)
                if stop < len(child.label):
                    child = self._split(child, stop)
                if pos >= counted:
                    child.count += 1
            child.stamp = clock
            node.last = child
            if node.best is None or child.count >= node.best.count:
                node.best = child
            path.append(child)
            node, pos = child, pos + stop
        self._touch(path)

    def _attach(self, parent: _Node, label: tuple[int, ...]) -> _Node:
        leaf = _Node(parent, label, 1, self._clock)
        if parent.children is None:
            parent.children = {}
        parent.children[label[0]] = leaf
        self._lru[leaf] = None
        self._entries += len(label)
        return leaf

    def _split(self, node: _Node, stop: int) -> _Node:
        """Cuts `node`'s edge after `stop` tokens; returns the new upper node."""
        parent, lower = node.parent, node.label[stop:]
        upper = _Node(parent, node.label[:stop], node.count, node.stamp)
        upper.children, upper.last, upper.best = {lower[0]: node}, node, node
        parent.children[upper.label[0]] = upper
        parent.last = upper if parent.last is node else parent.last
        parent.best = upper if parent.best is node else parent.best
        node.parent, node.label = upper, lower
        self._lru[upper] = None  # the caller's touch orders it; the edge's tokens are only re-cut
        return upper

    def _touch(self, path: list[_Node]) -> None:
        move = self._lru.move_to_end
        for node in reversed(path):  # deepest first: each node stays younger than its descendants
            move(node)

    def _evict(self) -> None:
        """Pops the oldest leaves until entries <= capacity; drops a root left empty."""
        while self._entries > self.capacity:
            leaf, _ = self._lru.popitem(last=False)
            self._entries -= len(leaf.label)
            parent = leaf.parent
            children = parent.children
            del children[leaf.label[0]]
            if children:
                if parent.last is leaf or parent.best is leaf:
                    parent.last = max(children.values(), key=attrgetter("stamp"))
                    parent.best = max(children.values(), key=attrgetter("count", "stamp"))
                continue
            parent.children = parent.last = parent.best = None
            if isinstance(parent, _Root) and self._roots.get(parent.namespace) is parent:
                del self._roots[parent.namespace]
                self._recent.pop(parent.namespace, None)


def _locate(root: _Root, gram: tuple[int, ...]) -> _Location | None:
    """Where `gram` (not empty) ends in the trie below `root`, or None when it never occurred."""
    node, pos, path, piece = root, 0, [], gram
    while pos < len(gram):
        node = node.children.get(gram[pos]) if node.children else None
        if node is None:
            return None
        piece = gram[pos:pos + len(node.label)]
        if node.label[:len(piece)] != piece:
            return None
        path.append(node)
        pos += len(piece)
    return _Location(path, len(piece))


def _shared(label: tuple[int, ...], segment: tuple[int, ...], pos: int) -> int:
    """How many leading tokens of `label` segment[pos:] follows (at least its first, which the
    children dict matched)."""
    piece = segment[pos:pos + len(label)]
    if piece == label:
        return len(label)
    n = 1
    while n < len(piece) and piece[n] == label[n]:
        n += 1
    return n


def _extended(recent: list[tuple[int, bytes]], data: bytes) -> tuple[int, bytes] | None:
    """The longest of `recent` (length, digest) that `data` (int64 tokens) starts with."""
    view = memoryview(data)
    for entry in sorted(recent, key=lambda entry: entry[0], reverse=True):
        if 8 * entry[0] <= len(data) and _digest(view[:8 * entry[0]]) == entry[1]:
            return entry
    return None


def _digest(data: bytes | memoryview) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def _check_windows(min_window: int, max_window: int) -> None:
    if min_window < 1:
        raise ValueError(f"min_window must be >= 1, got {min_window}")
    if max_window < min_window:
        raise ValueError(f"max_window must be >= min_window ({min_window}), got {max_window}")
