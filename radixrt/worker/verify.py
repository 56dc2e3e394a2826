"""Verification of speculative drafts, on rank 0 after a step's forward.

A verifying entry ran its last accepted token and draft_len drafts as one extend: row j of
its draft_len + 1 sample rows holds the target's logits for the token after draft j (row 0:
after the last accepted token). Each row is sampled exactly as plain decoding would sample
that position (Sampler.sample_chains); the request keeps the drafts up to the first one its
row's sample disagrees with, and then that sample (or, with every draft kept, the last
row's). For a greedy request this is the longest prefix of drafts that matches the target's
argmax; for a sampled one it is speculative sampling with a deterministic draft: a draft is
kept iff the token drawn from the target's distribution equals it, so every emitted token is
a draw from the target's distribution given the tokens before it, as without speculation.
"""

from __future__ import annotations

import logging

import torch

from radixrt.messages import BatchEntry, SpecVerdict
from radixrt.worker.logprobs import LogitRows
from radixrt.worker.sampler import Sampler

logger = logging.getLogger(__name__)


def accepted_length(draft: list[int], sampled: list[int]) -> int:
    """Drafts kept: how many of draft agree with sampled (len(draft) + 1 rows), from the first on."""
    n = 0
    while n < len(draft) and draft[n] == sampled[n]:
        n += 1
    return n


def verify_chains(
    sampler: Sampler, entries: list[BatchEntry], rows: LogitRows, logits: torch.Tensor, chains: list[int]
) -> dict[int, tuple[SpecVerdict, int] | str]:
    """Per verifying entry index: (its verdict, its next id), or why its sampling failed. The
    sampler records each entry's accepted tokens. All chains are sampled at once; if that
    raises, entry by entry, so that one request's parameters fail only that request."""
    try:
        return _verify(sampler, entries, rows, logits, chains)
    except Exception as e:  # noqa: BLE001 - one request's parameters: found entry by entry below
        logger.warning("verifying %d chains failed (%s: %s); entry by entry", len(chains), type(e).__name__, e)
    out: dict[int, tuple[SpecVerdict, int] | str] = {}
    for i in chains:
        try:
            out |= _verify(sampler, entries, rows, logits, [i])
        except Exception as e:
            logger.exception("verifying slot %d failed", entries[i].slot)
            out[i] = f"sampling failed: {type(e).__name__}: {e}"
    return out


def _verify(
    sampler: Sampler, entries: list[BatchEntry], rows: LogitRows, logits: torch.Tensor, chains: list[int]
) -> dict[int, tuple[SpecVerdict, int] | str]:
    pos: list[int] = []
    slots: list[int] = []
    offsets: list[int] = []
    for i in chains:
        e, first = entries[i], rows.entry_sample[i]
        assert first is not None and not e.allowed, "a verifying entry samples, unconstrained"
        pos += range(first, first + e.draft_len + 1)
        slots += [e.slot] * (e.draft_len + 1)
        offsets += range(e.draft_len + 1)
    sampled = sampler.sample_chains(logits[pos], slots, offsets)
    out: dict[int, tuple[SpecVerdict, int] | str] = {}
    at = 0
    for i in chains:
        e = entries[i]
        draft, got = e.input_ids[len(e.input_ids) - e.draft_len :], sampled[at : at + e.draft_len + 1]
        at += e.draft_len + 1
        n = accepted_length(draft, got)
        sampler.advance(e.slot, n + 1)
        out[i] = (SpecVerdict(draft, n), got[n])
    return out
