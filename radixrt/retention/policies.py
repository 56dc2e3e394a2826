"""Bounded-KV retention in pages: what a request under a policy keeps, and which pages leave.

Pure Python, for KVMemory. Each policy is a class in POLICIES, keyed by its
RetentionPolicy: it sizes a request's budget from the settings and orders the
pages it may drop. A budget is whole pages: sinks (sink_window's first pages,
kept for good), a recent window, heavy hitters (heavy_hitter's pages with the
most accumulated attention mass), and one more page, the one being filled.
Before each step KVMemory asks `drops` which full pages to give back so that,
after the step's new tokens, the page table holds at most `max_pages`; a step
never runs more than `chunk_tokens` of a prefill at once, so that every query of
a chunk sees at least about three quarters of what the policy keeps.

Positions (docs/architecture.md, "Bounded KV retention"): every token is computed at
its position in the sequence. sink_window re-rotates the sinks' keys by the number of
tokens dropped after them (the worker does it, from the keys as first computed), which
gives every query-key pair StreamingLLM's in-cache distance: the model never sees a
distance longer than what it keeps, so generation may run past its context length.
heavy_hitter keeps the original positions of what it keeps (as H2O does).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

from radixrt.settings.retention import Retention, RetentionPolicy

CHUNK_SHARE = 4  # a prefill chunk under a policy is at most 1/CHUNK_SHARE of its droppable pages


@dataclass(frozen=True)
class RetentionBudget(ABC):
    """One request's pages under a bounded policy (the subclass), and the order they leave in."""

    policy: ClassVar[RetentionPolicy]
    wants_mass: ClassVar[bool] = False  # drops by per-page attention mass: the worker must report it
    page_size: int
    sink_pages: int = 0  # leading pages never dropped
    window_pages: int = 0  # the most recent full pages, never dropped while older ones remain
    heavy_pages: int = 0  # pages kept for their attention mass

    @classmethod
    @abstractmethod
    def of(cls, r: Retention, page_size: int) -> RetentionBudget:
        """The budget of settings r (of this class's policy) in pages of page_size tokens."""

    @abstractmethod
    def drop_order(self, full: int, page_mass: list[float]) -> list[int]:
        """Page-table indices of the droppable pages among the first `full` (the full ones), first to go first."""

    @property
    def max_pages(self) -> int:
        """The most pages the request's page table holds after any step."""
        return self.sink_pages + self.window_pages + self.heavy_pages + 1

    @property
    def max_tokens(self) -> int:
        return self.max_pages * self.page_size

    @property
    def sink_tokens(self) -> int:
        return self.sink_pages * self.page_size

    @property
    def chunk_tokens(self) -> int:
        """The most tokens one step runs for the request."""
        return max(1, (self.window_pages + self.heavy_pages) // CHUNK_SHARE) * self.page_size

    def first_tokens(self, kv_len: int, n: int) -> int:
        """How many of n tokens the step that admits the request (with kv_len tokens from the
        prefix cache) runs: a chunk that needs no drop yet (admission counts no drops)."""
        return max(0, min(n, self.chunk_tokens, self.max_tokens - kv_len))

    def drops(self, kv_len: int, n: int, page_mass: list[float]) -> list[int]:
        """Page-table indices of the full pages to drop before running n more tokens on kv_len,
        in the order chosen (n <= chunk_tokens)."""
        excess = math.ceil((kv_len + n) / self.page_size) - self.max_pages
        if excess <= 0:
            return []
        order = self.drop_order(kv_len // self.page_size, page_mass)  # the page being filled is never dropped
        assert len(order) >= excess, f"{excess} pages to drop, {len(order)} droppable: the chunk is too large"
        return order[:excess]


class SinkWindow(RetentionBudget):
    """StreamingLLM: the sinks (sink_tokens rounded up to pages) and the recent window; the oldest
    pages after the sinks go first."""

    policy = RetentionPolicy.SINK_WINDOW

    @classmethod
    def of(cls, r: Retention, page_size: int) -> SinkWindow:
        return cls(page_size, sink_pages=math.ceil(r.sink_tokens / page_size),
                   window_pages=math.ceil(r.window_tokens / page_size))

    def drop_order(self, full: int, page_mass: list[float]) -> list[int]:
        return list(range(self.sink_pages, full))


class HeavyHitter(RetentionBudget):
    """H2O: the recent window and heavy_ratio * window_tokens more, the pages with the most
    accumulated attention mass; the least attended pages outside the recent window go first,
    then the oldest recent ones if a step needs more."""

    policy = RetentionPolicy.HEAVY_HITTER
    wants_mass = True

    @classmethod
    def of(cls, r: Retention, page_size: int) -> HeavyHitter:
        return cls(page_size, window_pages=math.ceil(r.window_tokens / page_size),
                   heavy_pages=math.ceil(r.heavy_ratio * r.window_tokens / page_size))

    def drop_order(self, full: int, page_mass: list[float]) -> list[int]:
        recent = max(0, full - self.window_pages)
        order = sorted(range(recent), key=lambda j: (page_mass[j] if j < len(page_mass) else 0.0, j))
        return order + list(range(recent, full))


# The bounded policies; RetentionPolicy.NONE keeps every token and has no budget.
POLICIES: dict[RetentionPolicy, type[RetentionBudget]] = {p.policy: p for p in (SinkWindow, HeavyHitter)}


def budget_for(r: Retention | None, page_size: int) -> RetentionBudget | None:
    """The page budget of settings r; None: the request keeps all its KV (no settings, or policy none)."""
    if r is None or not r.active:
        return None
    return POLICIES[r.policy].of(r, page_size)


def wants_mass(policy: RetentionPolicy) -> bool:
    """Whether the policy drops by attention mass (which the attention backend must report)."""
    return policy in POLICIES and POLICIES[policy].wants_mass
