"""Draft trees as lists (speculative/draft_tree.py) and the worker's side of them
(worker/draft_trees.py): masks, depths, the walk that verification takes, and the KV moves
that put a kept branch where its sequence continues."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from radixrt.kernels import LayerAttention

from radixrt.messages import BatchEntry, SpecVerdict
from radixrt.speculative.draft_tree import (
    ancestry,
    check_tree,
    depths,
    is_chain,
    moves,
    walk,
)
from radixrt.worker.draft_trees import (
    branch_copies,
    depth_shifts,
    kept_paths,
    refuse_trees,
    tree_masks,
)

pytestmark = pytest.mark.unit

TREE = [-1, -1, 0, 0, 1, 3]  # root -> {0, 1}; 0 -> {2, 3}; 1 -> {4}; 3 -> {5}


@st.composite
def trees(draw) -> list[int]:
    n = draw(st.integers(0, 12))
    return [draw(st.integers(-1, j - 1)) for j in range(n)]


def test_shape_of_a_tree():
    assert depths(TREE) == [1, 1, 2, 2, 2, 3]
    rows = ancestry(TREE)
    assert [c for c in range(7) if rows[6][c]] == [0, 1, 4, 6]  # draft 5: root, 0, 3, itself
    assert is_chain([-1, 0, 1]) and is_chain([]) and not is_chain(TREE)
    with pytest.raises(ValueError, match="parent"):
        check_tree([-1, 1])


@given(trees(), st.lists(st.integers(0, 3), min_size=13, max_size=13), st.lists(st.integers(0, 3), min_size=12,
                                                                                  max_size=12))
def test_walk_follows_samples_down_the_tree(parents, sampled, tokens):
    """Against a naive walk: the kept branch is the longest root path whose every draft is the
    sample of its parent's row; no duplicate siblings are assumed."""
    draft = tokens[: len(parents)]
    path = walk(draft, parents, sampled)
    node = -1
    for j in path:
        assert parents[j] == node and draft[j] == sampled[node + 1]
        node = j
    nxt = sampled[node + 1]
    first_children = {}
    for j, p in enumerate(parents):
        first_children.setdefault((p, draft[j]), j)
    assert (node, nxt) not in first_children  # the walk stops only where no child matches
    assert [depths(parents)[j] for j in path] == list(range(1, len(path) + 1))


def test_a_chain_walks_its_agreeing_prefix():
    assert walk([5, 6, 7], [-1, 0, 1], [5, 6, 9, 1]) == [0, 1]
    assert walk([5, 6, 7], [-1, 0, 1], [4, 6, 7, 1]) == []


@given(trees(), st.data())
def test_moves_put_the_branch_in_order(parents, data):
    """Applying the moves in any single read-then-write pass leaves kept draft i at index i."""
    sampled = data.draw(st.lists(st.integers(0, 2), min_size=len(parents) + 1, max_size=len(parents) + 1))
    draft = data.draw(st.lists(st.integers(0, 2), min_size=len(parents), max_size=len(parents)))
    path = walk(draft, parents, sampled)
    kv = list(range(len(parents)))
    src, dst = zip(*moves(path)) if moves(path) else ((), ())
    read = [kv[s] for s in src]
    for d, x in zip(dst, read):
        kv[d] = x
    assert kv[: len(path)] == path
    assert all(s > d for s, d in zip(src, dst))


def entry(slot, start, n_inputs, parents, draft_len):
    return BatchEntry(slot=slot, input_ids=list(range(n_inputs)), start_pos=start, new_pages=[], sample=True,
                      draft_len=draft_len, draft_parents=parents)


def test_worker_masks_shifts_and_copies():
    plain = entry(0, 4, 3, [], 0)  # a prefill chunk beside
    tree = entry(1, 10, 7, TREE, 6)
    chain = entry(2, 20, 3, [], 2)
    entries = [plain, tree, chain]
    masks = tree_masks(entries, torch.device("cpu"))
    assert list(masks) == [1] and masks[1].tolist() == ancestry(TREE)
    shift = depth_shifts(entries, masks, torch.device("cpu")).tolist()
    assert shift == [0, 0, 0] + [0, 0, 1, 1, 2, 3, 3] + [0, 0, 0]  # row j + 1 of the tree: j + 1 - depth
    verdicts = {1: SpecVerdict(list(range(6)), 3, [0, 3, 5])}
    paths = kept_paths(entries, verdicts)
    assert paths == [0, 3, 5, -1, -1, -1]
    slots, src, dst = branch_copies(entries, paths)
    assert slots == [1, 1] and src == [11 + 3, 11 + 5] and dst == [11 + 1, 11 + 2]  # draft 0 at cache index 11
    assert kept_paths(entries, {}) == [-1] * 6 and branch_copies(entries, [-1] * 6) == ([], [], [])


def test_flashinfer_refuses_trees_on_windowed_layers():
    with pytest.raises(ValueError, match="sliding-window"):
        refuse_trees("flashinfer", [LayerAttention(1.0, window=8), LayerAttention(1.0)])
    refuse_trees("flashinfer", [LayerAttention(1.0)])
    refuse_trees("torch", [LayerAttention(1.0, window=8)])
