"""Draft trees in the worker: what a verify step of entries with draft_parents needs beyond a
chain's (speculative/draft_tree.py says how a tree is laid out).

Before the forward: each tree's mask over its new rows (AttentionMetadata.trees) and the
rope positions of its drafts (the root's plus their depth, where a chain's are consecutive).
After verification: the kept branch's KV moves to the cache indices right after the root,
where its sequence continues, on every rank. Only rank 0 samples, so it shares the branches
kept (Ranks.share) before every rank copies.
"""

from __future__ import annotations

import itertools

import torch

from radixrt.kernels import LayerAttention
from radixrt.messages import BatchEntry, SpecVerdict
from radixrt.speculative.draft_tree import ancestry, check_tree, depths, moves


def tree_masks(entries: list[BatchEntry], device: torch.device) -> dict[int, torch.Tensor]:
    """Per entry verifying a tree: [qo_len, qo_len] bool, its rows causal up to the root, its
    drafts seeing those rows and their own ancestors."""
    out = {}
    for i, e in enumerate(entries):
        if e.draft_parents:
            check_tree(e.draft_parents)
            q_len, root = len(e.input_ids), len(e.input_ids) - e.draft_len - 1
            mask = torch.ones(q_len, q_len, dtype=torch.bool).tril_()
            mask[root:, root:] = torch.tensor(ancestry(e.draft_parents), dtype=torch.bool)
            out[i] = mask.to(device)
    return out


def depth_shifts(entries: list[BatchEntry], trees: dict[int, torch.Tensor], device: torch.device) -> torch.Tensor:
    """[T] int64: what each row's consecutive position exceeds its rope position by (a draft at
    depth d in row root + j + 1 sits at root + d)."""
    firsts = [0, *itertools.accumulate(len(e.input_ids) for e in entries)]
    shift = [0] * firsts[-1]
    for i in trees:
        e = entries[i]
        root = firsts[i] + len(e.input_ids) - e.draft_len - 1
        for j, d in enumerate(depths(e.draft_parents)):
            shift[root + j + 1] = j + 1 - d
    return torch.tensor(shift, dtype=torch.int64, device=device)


def kept_paths(entries: list[BatchEntry], verdicts: dict[int, SpecVerdict]) -> list[int]:
    """Rank 0: per tree entry, draft_len values: its kept branch (draft indices), then -1s
    (all -1 where it failed)."""
    out: list[int] = []
    for i, e in enumerate(entries):
        if e.draft_parents:
            path = verdicts[i].path if i in verdicts else []
            out += path + [-1] * (e.draft_len - len(path))
    return out


def branch_copies(entries: list[BatchEntry], paths: list[int]) -> tuple[list[int], list[int], list[int]]:
    """(slots, from, to): the cache indices each kept draft's KV moves between, per move its
    entry's slot; paths as kept_paths gives them."""
    slots: list[int] = []
    src: list[int] = []
    dst: list[int] = []
    at = 0
    for e in entries:
        if not e.draft_parents:
            continue
        path = [p for p in paths[at : at + e.draft_len] if p >= 0]
        at += e.draft_len
        first = e.start_pos + len(e.input_ids) - e.draft_len  # draft 0's cache index
        for j, i in moves(path):
            slots.append(e.slot)
            src.append(first + j)
            dst.append(first + i)
    return slots, src, dst


def refuse_trees(backend: str, layers: list[LayerAttention]) -> None:
    """ValueError where a backend cannot verify draft trees exactly on these layers."""
    if backend == "flashinfer" and any(la.window is not None for la in layers):
        raise ValueError("draft trees (speculative_ngram_max_bfs_breadth > 1) are not supported with attention_backend "
                         "'flashinfer' on a model with sliding-window layers: FlashInfer windows a draft by its row, "
                         "not its depth; use speculative_ngram_max_bfs_breadth 1 or attention_backend 'torch'")
