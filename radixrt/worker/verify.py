"""Verification of speculative drafts, on rank 0 after a step's forward.

A verifying entry ran its last accepted token and draft_len drafts as one extend: row j + 1
of its draft_len + 1 sample rows holds the target's logits for the token after draft j (row
0: after the last accepted token), a draft seeing the drafts on its path only (a chain's:
all before it; a tree's: its ancestors, speculative/draft_tree.py). Each row is sampled
exactly as plain decoding would sample that position (Sampler.sample_chains, at the row's
depth); from the root the request follows the child whose token its row's sample names,
while there is one, and then takes that sample. For a greedy request this is the longest
branch of drafts that matches the target's argmax; for a sampled one it is speculative
sampling with deterministic drafts: a draft is kept iff the token drawn from the target's
distribution at its parent equals it, so every emitted token is a draw from the target's
distribution given the tokens before it, as without speculation.
"""

from __future__ import annotations

import logging

import torch

from radixrt.messages import BatchEntry, SpecVerdict
from radixrt.speculative.draft_tree import depths, walk
from radixrt.worker.logprobs import LogitRows
from radixrt.worker.sampler import Sampler

logger = logging.getLogger(__name__)


def parents_of(e: BatchEntry) -> list[int]:
    """The entry's draft tree (a chain's, when it sent none)."""
    return e.draft_parents or list(range(-1, e.draft_len - 1))


def verify_drafts(
    sampler: Sampler, entries: list[BatchEntry], rows: LogitRows, logits: torch.Tensor, verifying: list[int]
) -> dict[int, tuple[SpecVerdict, int] | str]:
    """Per verifying entry index: (its verdict, its next id), or why its sampling failed. The
    sampler records each entry's accepted tokens. All entries are sampled at once; if that
    raises, entry by entry, so that one request's parameters fail only that request."""
    try:
        return _verify(sampler, entries, rows, logits, verifying)
    except Exception as e:  # noqa: BLE001 - one request's parameters: found entry by entry below
        logger.warning("verifying %d entries failed (%s: %s); entry by entry", len(verifying), type(e).__name__, e)
    out: dict[int, tuple[SpecVerdict, int] | str] = {}
    for i in verifying:
        try:
            out |= _verify(sampler, entries, rows, logits, [i])
        except Exception as e:
            logger.exception("verifying slot %d failed", entries[i].slot)
            out[i] = f"sampling failed: {type(e).__name__}: {e}"
    return out


def _verify(
    sampler: Sampler, entries: list[BatchEntry], rows: LogitRows, logits: torch.Tensor, verifying: list[int]
) -> dict[int, tuple[SpecVerdict, int] | str]:
    pos: list[int] = []
    slots: list[int] = []
    offsets: list[int] = []
    for i in verifying:
        e, first = entries[i], rows.entry_sample[i]
        assert first is not None and not e.allowed, "a verifying entry samples, unconstrained"
        pos += range(first, first + e.draft_len + 1)
        slots += [e.slot] * (e.draft_len + 1)
        offsets += [0, *depths(parents_of(e))]  # a row samples the output position it would take
    sampled = sampler.sample_chains(logits[pos], slots, offsets)
    out: dict[int, tuple[SpecVerdict, int] | str] = {}
    at = 0
    for i in verifying:
        e = entries[i]
        draft, got = e.input_ids[len(e.input_ids) - e.draft_len :], sampled[at : at + e.draft_len + 1]
        at += e.draft_len + 1
        path = walk(draft, parents_of(e), got)
        sampler.advance(e.slot, len(path) + 1)
        out[i] = (SpecVerdict(draft, len(path), path if e.draft_parents else []), got[path[-1] + 1 if path else 0])
    return out
