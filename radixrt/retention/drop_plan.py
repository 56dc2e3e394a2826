"""Dropping a retention request's pages: the page-table side of bounded-KV retention.

KVMemory (scheduler/kv_retention.py) calls these before a step of a request under a policy (its RetentionBudget
says which pages), on the request's KVHandle. The rule that keeps the prefix cache
correct: until its first drop a request's KV is ordinary (it attended to everything
before it), so it came from the cache and goes to it like any other. At the first
drop the request takes private copies of the cache's pages it still reads and lets
go of the cache, and from then on nothing it computed goes to the cache: that KV
attended to a context with holes, which no token prefix in the tree describes (a
namespace per policy would not help: a tree path cannot have holes), so it is never
served to anyone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from radixrt.messages import Retain
from radixrt.retention.policies import RetentionBudget


class RetainedKV(Protocol):
    """The fields of a request's KVHandle (scheduler/kv_handle.py) that a drop reads and rewrites."""

    pages: list[int]  # page table: KV of positions [0, kv_len)
    kv_len: int  # tokens whose KV is in `pages`
    pages_sent: int  # leading pages the worker's page table already has
    dropped: int  # tokens whose pages were dropped
    page_mass: list[float]  # each page's accumulated attention mass

    def owns(self, j: int) -> bool:
        """Whether the request owns its j-th page (else the prefix cache does)."""
        ...


@dataclass(frozen=True)
class DropPlan:
    """Before a step of n tokens: the page-table indices to drop and to keep, the kept ones
    that must become private copies (first drop only), and the dropped pages it frees."""

    drop: list[int]
    keep: list[int]
    copies: list[int]
    freed: list[int]

    def pages_needed(self, kv_len: int, n: int, page_size: int) -> int:
        """Pages to allocate net of the ones it frees first (never below 0)."""
        new = math.ceil((kv_len - len(self.drop) * page_size + n) / page_size) - len(self.keep)
        return max(0, new + len(self.copies) - len(self.freed))


def plan(kv: RetainedKV, budget: RetentionBudget | None, n: int) -> DropPlan | None:
    """What a request with this KV and budget drops before running n more tokens; None when it drops nothing."""
    drop = budget.drops(kv.kv_len, n, kv.page_mass) if budget is not None else []
    if not drop:
        return None
    dropped = set(drop)
    keep = [j for j in range(len(kv.pages)) if j not in dropped]
    copies = [j for j in keep if not kv.owns(j)] if kv.dropped == 0 else []
    return DropPlan(drop, keep, copies, [kv.pages[j] for j in drop if kv.owns(j)])


def rewrite(kv: RetainedKV, budget: RetentionBudget, p: DropPlan, page_size: int) -> Retain:
    """The page table without p's dropped pages (its copies and frees done); returns what the
    worker must do to the slot before the step."""
    sinks, first = budget.sink_tokens, kv.dropped == 0
    mass = kv.page_mass + [0.0] * (len(kv.pages) - len(kv.page_mass))
    kv.pages, kv.page_mass = [kv.pages[j] for j in p.keep], [mass[j] for j in p.keep]
    kv.kv_len -= len(p.drop) * page_size
    kv.dropped += len(p.drop) * page_size
    kv.pages_sent = len(kv.pages)
    return Retain(list(kv.pages), sinks, kv.dropped if sinks else 0, save_sinks=first and sinks > 0)


def add_mass(kv: RetainedKV, mass: list[float]) -> None:
    """Accumulate one step's per-page attention mass (aligned with the page table)."""
    acc = kv.page_mass
    acc += [0.0] * (len(mass) - len(acc))
    for j, m in enumerate(mass):
        acc[j] += m
