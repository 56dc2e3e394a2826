"""Draft trees from the n-gram index (ngram_tree.py) against brute-force models, with hypothesis.

NaiveGrams keeps the raw walks an NgramIndex makes (one per start position, in clock order) and
answers, for any gram, which tokens followed it with their counts and latest walk: the trie's
children, without the trie. `naive_tree` builds BFS and PROB trees from it, and the tree from
the index must equal it exactly. Independent of both: every path occurred in an indexed
sequence right after a suffix of the context, the tree is topological with no duplicate
siblings, BFS respects its breadths, max_breadth 1 starts with `propose`'s chain, PROB takes
the likeliest branches first, namespaces never mix, and the nodes read are touched.
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from itertools import count

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixrt.speculative.ngram_index import RECENT_SEQUENCES, NgramIndex, _locate
from radixrt.speculative.ngram_tree import DraftTree, propose_tree

TOKENS = st.lists(st.integers(0, 3), max_size=12)
WINDOWS = st.integers(1, 3).flatmap(lambda lo: st.tuples(st.just(lo), st.integers(lo, 4)))
BREADTHS = st.integers(1, 4).flatmap(lambda lo: st.tuples(st.just(lo), st.integers(lo, 6)))
OPS = st.lists(st.tuples(st.sampled_from("ab"), st.booleans(), TOKENS), max_size=6)  # (namespace, extend?, tokens)
FAST = settings(max_examples=120, deadline=None)


class NaiveGrams:
    """The walks NgramIndex.add makes, kept raw: (segment, how many leading tokens an
    extension's walk does not count again) per namespace, in clock order."""

    def __init__(self, lo: int, hi: int, branch: int) -> None:
        self.lo, self.hi, self.branch, self.depth = lo, hi, branch, hi + branch
        self.walks: dict[str, list[tuple[list[int], int]]] = {}
        self.recent: dict[str, list[list[int]]] = {}
        self.sequences: dict[str, list[list[int]]] = {}

    def add(self, ns: str, seq: list[int]) -> None:
        if not seq:
            return
        self.sequences.setdefault(ns, []).append(seq)
        recent = self.recent.setdefault(ns, [])
        prefixes = [old for old in recent if seq[:len(old)] == old]
        known = max(prefixes, key=len) if prefixes else []
        for start in range(max(0, len(known) - self.depth + 1), len(seq)):
            self.walks.setdefault(ns, []).append((seq[start:start + self.depth], len(known) - start))
        self.recent[ns] = ([old for old in recent if old is not known] + [seq])[-RECENT_SEQUENCES:]

    def following(self, ns: str, gram: list[int]) -> dict[int, tuple[int, int]]:
        """token -> (count, latest walk) over the walks that spelled gram + token."""
        out: dict[int, tuple[int, int]] = {}
        n = len(gram)
        for clock, (segment, counted) in enumerate(self.walks.get(ns, [])):
            if len(segment) > n and segment[:n] == gram:
                seen, _ = out.get(segment[n], (0, -1))
                out[segment[n]] = (seen + (n + 1 > counted), clock)
        return out

    def anchors(self, ns: str, context: list[int], longer_than: int) -> list[list[int]]:
        tail = context[-self.hi:]
        grams = [tail[len(tail) - n:] for n in range(len(tail), max(self.lo, longer_than + 1) - 1, -1)]
        return [gram for gram in grams if self.following(ns, gram)]


class Placer:
    """A tree being built: a token its parent already holds is merged."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.kids: dict[int, dict[int, int]] = {-1: {}}

    def place(self, parent: int, token: int) -> int:
        if token not in self.kids[parent]:
            self.kids[parent][token] = len(self.tokens)
            self.kids[len(self.tokens)] = {}
            self.tokens.append(token)
            self.parents.append(parent)
        return self.kids[parent][token]


def naive_tree(naive: NaiveGrams, match_type: str, ns: str, context: list[int], k: int,
               lo_b: int, hi_b: int, longer_than: int = 0) -> DraftTree:
    """SGLang's BFS / PROB tree, reading NaiveGrams instead of a trie."""
    tree = Placer()
    scale = (hi_b - lo_b) / (naive.hi - naive.lo + 1)
    for gram in naive.anchors(ns, context, longer_than) if k > 0 else []:
        if match_type == "BFS":
            naive_bfs(naive, ns, gram, tree, k, (naive.hi - len(gram)) * scale + lo_b, scale)
        else:
            naive_prob(naive, ns, gram, tree, k, hi_b)
    return DraftTree(tree.tokens, tree.parents)


def naive_bfs(naive: NaiveGrams, ns: str, gram: list[int], tree: Placer, k: int, breadth: float,
              scale: float) -> None:
    queue = deque([(-1, breadth, [])])
    while queue and len(tree.tokens) < k:
        parent, breadth, path = queue.popleft()
        nxt = naive.following(ns, gram + path) if len(path) < naive.branch else {}
        for token in sorted(nxt, key=lambda t: -nxt[t][1])[:max(1, int(breadth))]:  # the latest first
            if len(tree.tokens) == k:
                break
            queue.append((tree.place(parent, token), breadth - scale, path + [token]))


def naive_prob(naive: NaiveGrams, ns: str, gram: list[int], tree: Placer, k: int, top: int) -> None:
    heap: list[tuple[float, int, int, list[int]]] = []
    tie = count()
    entries = [(1.0, -1, [])]  # (score, tree parent, path) whose continuations to offer
    while entries:
        score, parent, path = entries.pop()
        nxt = naive.following(ns, gram + path) if len(path) < naive.branch else {}
        best = sorted(nxt, key=lambda t: nxt[t], reverse=True)[:top]  # by count, then the latest
        total = sum(nxt[t][0] for t in best)
        for t in best:
            heapq.heappush(heap, (-(score * (nxt[t][0] / total)), next(tie), parent, path + [t]))
        if heap and len(tree.tokens) < k:
            neg, _, parent, path = heapq.heappop(heap)
            entries.append((-neg, tree.place(parent, path[-1]), path))


def build(ops, lo: int, hi: int, branch: int, match_type: str) -> tuple[NgramIndex, NaiveGrams, dict[str, list[int]]]:
    index, naive = NgramIndex(lo, hi, branch, match_type=match_type), NaiveGrams(lo, hi, branch)
    last: dict[str, list[int]] = {}
    for ns, extend, tokens in ops:
        last[ns] = last.get(ns, []) + tokens if extend else tokens
        index.add(ns, last[ns])
        naive.add(ns, last[ns])
    return index, naive, last


def paths(tree: DraftTree) -> list[list[int]]:
    out: list[list[int]] = []
    for token, parent in zip(tree.tokens, tree.parents):
        out.append((out[parent] if parent >= 0 else []) + [token])
    return out


def assert_shape(tree: DraftTree, k: int) -> None:
    """At most k nodes, topological, no two siblings with one token."""
    assert len(tree.tokens) == len(tree.parents) <= max(k, 0)
    assert all(-1 <= p < j for j, p in enumerate(tree.parents))
    siblings = list(zip(tree.parents, tree.tokens))
    assert len(set(siblings)) == len(siblings)


def occurred(sequences: list[list[int]], suffixes: list[list[int]], path: list[int]) -> bool:
    """Whether some suffix followed by `path` occurs in some sequence."""
    for seq in sequences:
        for s in suffixes:
            want = s + path
            if any(seq[i:i + len(want)] == want for i in range(len(seq) - len(want) + 1)):
                return True
    return False


def lru_consistent(index: NgramIndex) -> bool:
    order = {node: i for i, node in enumerate(index._lru)}
    return all(order[kid] < order[node] for node in order for kid in (node.children or {}).values())


@FAST
@given(WINDOWS, st.integers(1, 4), st.sampled_from(["BFS", "PROB"]), BREADTHS, OPS,
       st.lists(TOKENS, max_size=3), st.integers(0, 2))
def test_trees_match_the_brute_force_model(windows, branch, match_type, breadths, ops, extra, longer_than):
    index, naive, last = build(ops, *windows, branch, match_type)
    contexts = extra + [seq[:i] for seq in last.values() for i in range(1, len(seq) + 1)]
    for context in contexts:
        for ns in "ab":
            suffixes = [context[len(context) - n:] for n in range(max(windows[0], longer_than + 1), windows[1] + 1)
                        if n <= len(context)]
            lengths = [len(gram) for gram in naive.anchors(ns, context, longer_than)]
            assert [n for n, _ in index.anchors(ns, context, longer_than)] == lengths
            for k in (1, 3, 9):
                tree = propose_tree(index, ns, context, k, *breadths, longer_than=longer_than)
                assert tree == naive_tree(naive, match_type, ns, context, k, *breadths, longer_than), (ns, context, k)
                assert_shape(tree, k)
                for path in paths(tree):
                    assert len(path) <= branch and occurred(naive.sequences.get(ns, []), suffixes, path)
    assert lru_consistent(index)


@FAST
@given(WINDOWS, st.integers(1, 5), st.sampled_from(["BFS", "PROB"]), OPS, st.integers(1, 9))
def test_breadth_one_starts_with_the_proposed_chain(windows, branch, match_type, ops, k):
    index, _, last = build(ops, *windows, branch, match_type)
    for context in [seq[:i] for seq in last.values() for i in range(len(seq) + 1)]:
        chain = index.propose("a", context, k)
        tree = propose_tree(index, "a", context, k, 1, 1)
        assert tree.tokens[:len(chain)] == chain and tree.parents[:len(chain)] == list(range(-1, len(chain) - 1))
        if len(chain) == k or len(list(index.anchors("a", context))) <= 1:
            assert tree == DraftTree(chain, list(range(-1, len(chain) - 1)))


@pytest.mark.parametrize("match_type", ["BFS", "PROB"])
def test_breadth_one_equals_propose_on_long_text(match_type):
    rng = random.Random(3)
    index = NgramIndex(match_type=match_type)
    sequences = [[rng.randrange(30) for _ in range(2000)] for _ in range(3)]
    for seq in sequences:
        index.add("n", seq)
    for seq in sequences:
        for end in range(20, 2000, 97):
            chain = index.propose("n", seq[:end], 8)
            assert len(chain) == 8
            assert propose_tree(index, "n", seq[:end], 8, 1, 1) == DraftTree(chain, list(range(-1, 7)))


def test_shorter_anchors_add_to_the_tree_as_in_sglang():
    """`propose` reads only the longest suffix; a tree also takes what shorter ones offer."""
    index = NgramIndex(1, 3, 4)
    index.add("n", [1, 2, 3, 4])
    index.add("n", [9, 2, 3, 5, 6])  # 2 3 was followed more recently by 5
    assert index.propose("n", [1, 2, 3], 4) == [4]
    assert propose_tree(index, "n", [1, 2, 3], 4, 1, 1) == DraftTree([4, 5, 6], [-1, -1, 1])


def test_bfs_breadth_shrinks_by_level_and_widens_for_shorter_anchors():
    rng = random.Random(5)
    single = NgramIndex(2, 2, 4)  # one anchor length: scale = max_breadth - min_breadth
    for _ in range(200):
        single.add("n", [7, 8] + [rng.randrange(6) for _ in range(4)])
    tree = propose_tree(single, "n", [7, 8], 40, 3, 4)
    fanout = [0] * (len(tree.tokens) + 1)  # fanout[0]: the root's
    depth = [0] * len(tree.tokens)
    for j, p in enumerate(tree.parents):
        fanout[p + 1] += 1
        depth[j] = depth[p] + 1 if p >= 0 else 1
    assert fanout[0] == 3  # breadth 3, then 2, then 1
    assert max(fanout[j + 1] for j in range(len(depth)) if depth[j] == 1) == 2
    assert max(fanout[j + 1] for j in range(len(depth)) if depth[j] >= 2) == 1
    assert len(tree.tokens) == 3 + 3 * 2 + 6 + 6
    several = NgramIndex(1, 3, 4)  # scale (7 - 1) / 3 = 2: anchors of 3, 2, 1 tokens start with breadth 1, 3, 5
    for seq in ([1, 2, 3, 10], [5, 2, 3, 11], [6, 2, 3, 12], [5, 3, 13], [6, 3, 14], [8, 3, 15], [9, 3, 16]):
        several.add("n", seq)
    assert propose_tree(several, "n", [1, 2, 3], 16, 1, 7).tokens == [10, 12, 11, 16, 15, 14, 13]
    edge = NgramIndex(1, 4, 4)  # scale (6 - 1) / 4: the 1-token anchor starts at 4.75, one token down 3.5
    for last in (1, 2, 4, 5, 6):
        edge.add("n", [3, 0, last])  # 3 0 is one edge
    assert propose_tree(edge, "n", [9, 3], 16, 1, 6) == DraftTree([0, 6, 5, 4], [-1, 0, 0, 0])


def test_prob_takes_the_likeliest_branches_first():
    index = NgramIndex(2, 2, 3, match_type="PROB")
    tails = [[5, 6]] * 2 + [[5, 7]] * 2 + [[8, 9]] * 3 + [[4, 1]]
    for i, tail in enumerate(tails):
        index.add("n", [100 + i, 1, 2] + tail)  # distinct sequences, so each counts
    # after 1 2: 5 (4 times), 8 (3), 4 (1); the top 2 are offered: 5 at 4/7, 8 at 3/7. Then
    # 8 9 keeps 3/7 while 5's children split its 4/7 (2 each, the later first), and 4 never comes
    tree = propose_tree(index, "n", [3, 1, 2], 16, 1, 2)
    assert tree == DraftTree([5, 8, 9, 7, 6], [-1, -1, 1, 0, 0])
    assert propose_tree(index, "n", [3, 1, 2], 2, 1, 2) == DraftTree([5, 8], [-1, -1])
    assert propose_tree(index, "n", [3, 1, 2], 16, 1, 3).tokens == [5, 8, 9, 7, 6, 4, 1]


def test_namespaces_never_mix():
    index = NgramIndex(1, 3, 4)
    index.add("a", [1, 2, 3, 4, 5])
    index.add("b", [1, 2, 3, 40, 50])
    index.add("b", [2, 3, 41, 51])
    for match_type in ("BFS", "PROB"):
        index.match_type = match_type
        tree = propose_tree(index, "a", [1, 2, 3], 16, 1, 8)
        assert tree.tokens == [4, 5]
        assert set(propose_tree(index, "b", [1, 2, 3], 16, 1, 8).tokens) == {40, 50, 41, 51}


@pytest.mark.parametrize("match_type", ["BFS", "PROB"])
def test_the_nodes_read_are_touched(match_type):
    rng = random.Random(9)
    index = NgramIndex(2, 2, 5, match_type=match_type)
    index.add("n", [1, 2] + [rng.randrange(4) for _ in range(30)] + [1, 2, 3])
    for _ in range(20):
        index.add("n", [rng.randrange(8) for _ in range(12)])  # younger than the first add
    tree = propose_tree(index, "n", [1, 2], 8, 2, 3)
    root = index._roots["n"]
    read = {node for path in paths(tree) for node in _locate(root, (1, 2, *path)).path}
    assert len(tree.tokens) == 8 and set(list(index._lru)[-len(read):]) == read
    assert lru_consistent(index)


def test_empty_trees_and_bad_breadths():
    index = NgramIndex(2, 3, 4)
    index.add("n", [1, 2, 3, 4])
    assert propose_tree(index, "n", [1, 2], 4, 1, 2) == DraftTree([3, 4], [-1, 0])
    empty = DraftTree([], [])
    assert propose_tree(index, "n", [1, 2], 0, 1, 2) == empty == propose_tree(index, "n", [1, 2], -1, 1, 2)
    assert propose_tree(index, "other", [1, 2], 4, 1, 2) == empty
    assert propose_tree(index, "n", [2], 4, 1, 2) == empty  # shorter than min_window
    assert propose_tree(index, "n", [3, 4], 4, 1, 2) == empty  # occurred, nothing followed
    assert propose_tree(index, "n", [1, 2], 4, 1, 2, longer_than=2) == empty
    for lo, hi in ((0, 2), (3, 2)):
        with pytest.raises(ValueError, match="breadth"):
            propose_tree(index, "n", [1, 2], 4, lo, hi)
