"""The n-gram draft sources against brute-force models, with hypothesis.

SequenceLookup: the longest suffix (max_window down to min_window) that occurred earlier, and
what followed its most recent earlier occurrence. NgramIndex (BFS): a list of add events per
namespace, each draft token the one that followed the latest occurrence of (suffix + drafts so
far); an add that extends one of the namespace's recent sequences re-touches only the starts
whose paths reach past the old end. PROB on hand-made frequencies. Namespaces never read each
other; capacity always holds and the trie stays consistent (assert_index_consistent).
"""

from __future__ import annotations

import random
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixrt.speculative.ngram_index import RECENT_SEQUENCES, NgramIndex, SequenceLookup

TOKENS = st.lists(st.integers(0, 3), max_size=14)
WINDOWS = st.integers(1, 3).flatmap(lambda lo: st.tuples(st.just(lo), st.integers(lo, 4)))
# (namespace, extend the namespace's previous sequence?, tokens)
OPS = st.lists(st.tuples(st.sampled_from("ab"), st.booleans(), TOKENS), max_size=8)
FAST = settings(max_examples=150, deadline=None)


def naive_lookup(seq: list[int], lo: int, hi: int, k: int) -> list[int]:
    for n in range(min(hi, len(seq)), lo - 1, -1):
        for end in range(len(seq) - 2, n - 2, -1):  # an occurrence ending before the last token
            if seq[end - n + 1:end + 1] == seq[-n:]:
                return seq[end + 1:end + 1 + k] if k > 0 else []
    return []


class NaiveIndex:
    """NgramIndex BFS by brute force over the sequences added."""

    def __init__(self, lo: int, hi: int, branch: int) -> None:
        self.lo, self.hi, self.branch, self.depth = lo, hi, branch, hi + branch
        self.events: dict[str, list[tuple[list[int], int]]] = {}  # (sequence, first start re-touched)
        self.recent: dict[str, list[list[int]]] = {}

    def add(self, ns: str, seq: list[int]) -> None:
        if not seq:
            return
        recent = self.recent.setdefault(ns, [])
        prefixes = [old for old in recent if seq[:len(old)] == old]
        known = max(prefixes, key=len) if prefixes else []
        self.events.setdefault(ns, []).append((seq, max(0, len(known) - self.depth + 1)))
        self.recent[ns] = ([old for old in recent if old is not known] + [seq])[-RECENT_SEQUENCES:]

    def next_token(self, ns: str, s: list[int]) -> int | None:
        for seq, first in reversed(self.events.get(ns, [])):
            for j in range(len(seq) - len(s) - 1, first - 1, -1):
                if seq[j:j + len(s)] == s:
                    return seq[j + len(s)]
        return None

    def propose(self, ns: str, context: list[int], k: int) -> list[int]:
        tail = context[-self.hi:]
        for n in range(len(tail), self.lo - 1, -1):
            drafts: list[int] = []
            while len(drafts) < min(k, self.branch):
                token = self.next_token(ns, tail[len(tail) - n:] + drafts)
                if token is None:
                    break
                drafts.append(token)
            if drafts:
                return drafts
        return []


def run_ops(ops, *indexes) -> dict[str, list[int]]:
    """Applies `ops` to every index; returns each namespace's last sequence."""
    last: dict[str, list[int]] = {}
    for ns, extend, tokens in ops:
        seq = last.get(ns, []) + tokens if extend else tokens
        last[ns] = seq
        for index in indexes:
            index.add(ns, seq)
    return last


def contexts(last: dict[str, list[int]], extra: list[list[int]]) -> list[list[int]]:
    seqs = list(last.values())
    return extra + [seq[:i] for seq in seqs for i in range(len(seq) + 1)]


def assert_index_consistent(index: NgramIndex, evicted: bool = False) -> None:
    """Reachable nodes are exactly the LRU's, entries count their labels, choices match their
    definitions, every node is younger than its children, and (until an eviction loses counts
    that an extension's old part does not add again) counts never grow downwards."""
    order = {node: i for i, node in enumerate(index._lru)}
    seen, tokens = 0, 0
    stack = [(root, 0) for root in index._roots.values()]
    for root, _ in stack:
        assert root.parent is None and root.children, "an empty root is dropped"
    while stack:
        node, depth = stack.pop()
        kids = list((node.children or {}).values())
        assert all(kid.parent is node and kid.label and node.children[kid.label[0]] is kid for kid in kids)
        assert depth <= index._depth
        if kids:
            assert node.last is max(kids, key=lambda n: n.stamp)
            assert node.best is max(kids, key=lambda n: (n.count, n.stamp))
        else:
            assert node.last is None and node.best is None
        if node.parent is not None:  # not a root
            seen, tokens = seen + 1, tokens + len(node.label)
            assert evicted or sum(kid.count for kid in kids) <= node.count
            assert all(order[kid] < order[node] for kid in kids)
        stack += [(kid, depth + len(kid.label)) for kid in kids]
    assert seen == len(order) and tokens == index.entries


@FAST
@given(WINDOWS, st.lists(TOKENS, min_size=1, max_size=5), st.integers(-1, 6))
def test_sequence_lookup_matches_brute_force(windows, pieces, k):
    lookup, seq = SequenceLookup(*windows), []
    for piece in pieces:
        lookup.extend(piece)
        seq += piece
        assert len(lookup) == len(seq)
        assert lookup.propose(k) == naive_lookup(seq, *windows, k)


def test_sequence_lookup_prefers_the_longest_and_latest_match():
    lookup = SequenceLookup(1, 3)
    lookup.extend([1, 2, 3, 9, 2, 3, 8, 5, 1, 2, 3])
    assert lookup.propose(2) == [9, 2]  # 1 2 3 occurred once before; 2 3 later is shorter
    lookup.extend([7])
    assert lookup.propose(4) == []
    lookup.extend([2, 3])  # 7 2 3 never occurred; 2 3 last occurred before the 7
    assert lookup.propose(9) == [7, 2, 3]  # never past the end


@FAST
@given(WINDOWS, st.integers(1, 4), OPS, st.lists(TOKENS, max_size=4))
def test_bfs_matches_brute_force(windows, branch, ops, extra):
    index, naive = NgramIndex(*windows, branch_length=branch), NaiveIndex(*windows, branch)
    last = run_ops(ops, index, naive)
    assert_index_consistent(index)
    for context in contexts(last, extra):
        for ns in "ab":
            for k in (1, 3, 8):
                assert index.propose(ns, context, k) == naive.propose(ns, context, k), (ns, context, k)


@FAST
@given(st.sampled_from(["BFS", "PROB"]), OPS, st.lists(TOKENS, max_size=4))
def test_adds_to_one_namespace_never_change_another(match_type, ops, extra):
    both, only_a = NgramIndex(1, 3, 4, match_type=match_type), NgramIndex(1, 3, 4, match_type=match_type)
    last = run_ops(ops, both)
    run_ops([op for op in ops if op[0] == "a"], only_a)
    for context in contexts(last, extra):
        assert both.propose("a", context, 5) == only_a.propose("a", context, 5)


@FAST
@given(st.integers(1, 40), st.sampled_from(["BFS", "PROB"]), OPS)
def test_capacity_holds_and_eviction_never_crosses_namespaces(capacity, match_type, ops):
    index = NgramIndex(1, 3, 3, capacity=capacity, match_type=match_type)
    # b's tokens are 10..13: a proposal for "a" may lose drafts to b's adds, never show b's tokens
    ops = [(ns, extend, [t + 10 * (ns == "b") for t in tokens]) for ns, extend, tokens in ops]
    last: dict[str, list[int]] = {}
    for ns, extend, tokens in ops:
        last[ns] = last.get(ns, []) + tokens if extend else tokens
        index.add(ns, last[ns])
        assert index.entries <= capacity
        assert_index_consistent(index, evicted=True)
        for context in contexts(last, []):
            drafts = index.propose("a", context, 4)
            assert all(t < 10 for t in drafts)
            assert_index_consistent(index, evicted=True)  # a proposal reorders the LRU


def test_prob_follows_the_most_frequent_token_then_bfs_the_latest():
    sequences = [[0, 1, 2, 3, 5], [0, 1, 2, 3, 6], [0, 1, 2, 4, 7]]
    prob, bfs = NgramIndex(1, 2, 4, match_type="PROB"), NgramIndex(1, 2, 4)
    for seq in sequences:
        prob.add("n", seq)
        bfs.add("n", seq)
    assert prob.propose("n", [1, 2], 3) == [3, 6]  # 3 twice; after it 5 and 6 once each: the later
    assert bfs.propose("n", [1, 2], 3) == [4, 7]
    assert prob.propose("n", [9, 9, 3], 3) == [6]  # the longest suffix with a continuation is [3]


def test_prob_counts_an_extended_sequence_once():
    index = NgramIndex(1, 2, 2, match_type="PROB")
    for seq in ([6, 1, 2, 4], [7, 1, 2, 4], [1, 2, 3]):
        index.add("n", seq)
    index.add("n", [1, 2, 3, 9])  # extends [1, 2, 3]: not another occurrence of 1 2 3
    index.add("n", [1, 2, 3, 9, 9])
    assert index.propose("n", [1, 2], 1) == [4]
    index.add("n", [5, 1, 2, 3])  # a new occurrence: 3 ties 4 and is the latest
    assert index.propose("n", [1, 2], 1) == [3]


def test_readding_costs_only_the_new_part():
    rng = random.Random(0)
    index, seq = NgramIndex(), [rng.randrange(1000) for _ in range(2000)]
    index.add("n", seq)
    entries, walks = index.entries, []
    walk = index._walk
    index._walk = lambda *args: walks.append(args) or walk(*args)
    index.add("n", seq)
    assert index.entries == entries and len(walks) == index._depth - 1
    index.add("n", seq + [5, 6])
    assert len(walks) == 2 * (index._depth - 1) + 2
    assert index.propose("n", seq[:100], 8) == seq[100:108]
    assert index.propose("n", list(range(10**5)) + seq[:100], 8) == seq[100:108]  # reads only the tail


def test_edges_of_proposals():
    index = NgramIndex(2, 3, branch_length=3)
    index.add("n", [1, 2, 3, 4, 5, 6])
    assert index.propose("n", [1, 2], 10) == [3, 4, 5]  # branch_length caps
    assert index.propose("n", [1, 2], 0) == [] and index.propose("n", [1, 2], -1) == []
    assert index.propose("n", [2], 3) == []  # shorter than min_window
    assert index.propose("n", [5, 6], 3) == []  # occurred, but nothing followed
    assert index.propose("other", [1, 2], 3) == []
    index.add("n", [])
    assert_index_consistent(index)


def test_forget_clear_and_memory_estimate():
    rng = random.Random(1)
    a, b = [rng.randrange(50) for _ in range(300)], [rng.randrange(50) for _ in range(300)]
    index, only_b = NgramIndex(), NgramIndex()
    index.add("a", a)
    sizes = [(index.entries, index.approx_bytes)]
    index.add("b", b)
    only_b.add("b", b)
    sizes.append((index.entries, index.approx_bytes))
    assert sizes[0][0] < sizes[1][0] and sizes[0][1] < sizes[1][1]
    index.forget("a")
    index.forget("missing")
    assert index.propose("a", a[:50], 4) == [] and index.propose("b", b[:50], 4) == b[50:54]
    assert index.entries == only_b.entries and index.approx_bytes == only_b.approx_bytes
    assert_index_consistent(index)
    index.clear()
    assert index.entries == index.approx_bytes == 0 and index.propose("b", b[:50], 4) == []


@pytest.mark.parametrize("vocab", [4, 32000])
def test_approx_bytes_is_within_a_third_of_measured(vocab):
    rng = random.Random(vocab)
    sequences = [[rng.randrange(vocab) for _ in range(2000)] for _ in range(2)]
    tracemalloc.start()
    try:
        index = NgramIndex()
        for seq in sequences:
            index.add("n", seq)
        measured, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert 0.67 < index.approx_bytes / measured < 1.5


@pytest.mark.parametrize("kwargs, field", [
    ({"min_window": 0}, "min_window"), ({"min_window": 3, "max_window": 2}, "max_window"),
    ({"branch_length": 0}, "branch_length"), ({"capacity": 0}, "capacity"), ({"match_type": "DFS"}, "match_type"),
])
def test_invalid_settings_name_their_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        NgramIndex(**kwargs)


def test_sequence_lookup_validates_windows():
    with pytest.raises(ValueError, match="min_window"):
        SequenceLookup(0, 3)
    with pytest.raises(ValueError, match="max_window"):
        SequenceLookup(4, 3)
