"""Eviction policies: in what order a cache gives up what it holds.

One ordering serves every tier (`--radix-eviction-policy`): the device radix tree orders its
unlocked leaves by it (cache/radix_cache.py), and each lower tier its leaf pages
(cache/tier_index.py). An entry (a tree node, or one tier's page) carries a Stamp; the
EvictionOrder sets it when the entry is used and turns it into a sort key, lowest evicted first.

- lru: least recently used first (SGLang's default).
- lfu: fewest hits first, least recently used among equals (SGLang's `lfu`).
- cost: greedy-dual. An entry is worth its hits times what its pages cost to recompute per page
  (a deeper page attends over a longer prefix, so it costs more), plus an inflation that rises to
  the worth of each entry evicted, so hits long past age out (GreedyDual-Size-Frequency). A cheap,
  rarely hit page goes first; an old one goes before a fresh one of the same worth.

A hit is a request reading the entry (a match, a load from a lower tier); an insert or an
offload only makes it recent. Plain Python.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable

# A token's attention work per position it attends, in units of its other work: the model's own
# figure comes from its config (worker/tier_probe.attention_per_position); this is the fallback
# (attention costs as much as the rest of the forward at 4096 tokens of context).
DEFAULT_ATTENTION_PER_POSITION = 1 / 4096


class EvictionPolicy(str, enum.Enum):
    LRU = "lru"
    LFU = "lfu"
    COST = "cost"


@dataclass
class Stamp:
    """One entry's eviction state."""

    last_access: int = 0
    hits: int = 0
    worth: float = 0.0  # the cost policy's value (other policies leave it 0)


def relative_recompute_cost(start: int, n: int, attention_per_position: float = DEFAULT_ATTENTION_PER_POSITION) -> float:
    """What recomputing tokens [start, start + n) costs, in units of one token's forward without
    attention: each token's own work plus attention over the tokens before it."""
    return n * (1.0 + attention_per_position * (start + n / 2))


class EvictionOrder:
    """One policy's ordering; `cost(start, n)` prices recomputing n tokens from position start."""

    def __init__(self, policy: EvictionPolicy | str = EvictionPolicy.LRU,
                 cost: Callable[[int, int], float] = relative_recompute_cost) -> None:
        self.policy = EvictionPolicy(policy)
        self.cost = cost
        self.inflation = 0.0  # the cost policy's L: the worth of the last entry evicted

    def touch(self, s: Stamp, now: int, start: int, n: int, hit: bool) -> None:
        """The entry covering tokens [start, start + n) was used at `now` (a hit: read by a request)."""
        s.last_access = now
        if hit:
            s.hits += 1
        if self.policy is EvictionPolicy.COST:
            pages_cost = self.cost(start, n) / max(n, 1)  # per token: entries of any size compare
            s.worth = self.inflation + max(s.hits, 1) * pages_cost

    def key(self, s: Stamp) -> tuple:
        """The sort key: the smallest is evicted first."""
        if self.policy is EvictionPolicy.LRU:
            return (s.last_access,)
        if self.policy is EvictionPolicy.LFU:
            return (s.hits, s.last_access)
        return (s.worth, s.last_access)

    def evicted(self, s: Stamp) -> None:
        """The entry was given up: the cost policy's inflation rises to its worth."""
        if self.policy is EvictionPolicy.COST:
            self.inflation = max(self.inflation, s.worth)
