"""Bounded-KV retention in pages: what a request under a policy keeps, and which pages leave.

Pure Python, for KVMemory. A request's budget is whole pages: sinks (sink_window's
first pages, kept for good), a recent window, heavy hitters (heavy_hitter's pages
with the most accumulated attention mass), and one more page, the one being filled.
Before each step KVMemory asks `drops` which full pages to give back so that, after
the step's new tokens, the page table holds at most `max_pages`; a step never runs
more than `chunk_tokens` of a prefill at once, so that every query of a chunk sees
at least about three quarters of what the policy keeps.

Positions (docs/architecture.md, "Bounded KV retention"): every token is computed at
its position in the sequence. sink_window re-rotates the sinks' keys by the number of
tokens dropped after them (the worker does it, from the keys as first computed), which
gives every query-key pair StreamingLLM's in-cache distance: the model never sees a
distance longer than what it keeps, so generation may run past its context length.
heavy_hitter keeps the original positions of what it keeps (as H2O does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from radixrt.retention import Retention

CHUNK_SHARE = 4  # a prefill chunk under a policy is at most 1/CHUNK_SHARE of its droppable pages


@dataclass(frozen=True)
class RetentionBudget:
    policy: str  # "sink_window" | "heavy_hitter"
    page_size: int
    sink_pages: int  # leading pages never dropped (sink_window)
    window_pages: int  # the most recent full pages, never dropped while older ones remain
    heavy_pages: int  # pages kept for their attention mass (heavy_hitter)

    @classmethod
    def of(cls, r: Retention, page_size: int) -> RetentionBudget:
        assert r.active, "no budget for policy none"
        sink = math.ceil(r.sink_tokens / page_size) if r.policy == "sink_window" else 0
        window = math.ceil(r.window_tokens / page_size)
        heavy = math.ceil(r.heavy_ratio * r.window_tokens / page_size) if r.policy == "heavy_hitter" else 0
        return cls(r.policy, page_size, sink, window, heavy)

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
    def wants_mass(self) -> bool:
        return self.policy == "heavy_hitter"

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
        in the order chosen (n <= chunk_tokens). sink_window drops the oldest after the sinks;
        heavy_hitter the lowest accumulated mass outside the recent window, then the oldest
        recent ones if the step needs more."""
        excess = math.ceil((kv_len + n) / self.page_size) - self.max_pages
        if excess <= 0:
            return []
        full = kv_len // self.page_size  # the page being filled is never dropped
        if self.policy == "sink_window":
            order = list(range(self.sink_pages, full))
        else:
            recent = max(0, full - self.window_pages)
            order = sorted(range(recent), key=lambda j: (page_mass[j] if j < len(page_mass) else 0.0, j))
            order += list(range(recent, full))
        assert len(order) >= excess, f"{excess} pages to drop, {len(order)} droppable: the chunk is too large"
        return order[:excess]
