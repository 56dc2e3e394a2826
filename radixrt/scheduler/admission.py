"""Admission: whether one waiting request gets its pages this step, and how many tokens it runs.

A new request starts from its longest cached prefix; one that shares a not-yet-cached prefix
with a request computing it this step waits a step, so the shared part is computed once and
then hit. A swapped-out request comes back from host memory. Either way its pages must fit
beside the pages kept back for the running requests' growth; when they do not, it and every
later request in policy order wait (NO_ROOM). Putting an admitted request into the running
batch (its slot, its counts) is the scheduler's part.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from radixrt.scheduler.kv_memory import KVMemory
from radixrt.scheduler.req import Req


class Outcome(enum.Enum):
    ADMITTED = enum.auto()  # into the running batch
    WAIT = enum.auto()  # a request computing its prefix runs first; it waits a step and hits the cache
    NO_ROOM = enum.auto()  # its pages do not fit: it, and every later request in policy order, waits


@dataclass(frozen=True)
class Admission:
    """What trying to admit one waiting request came to."""

    outcome: Outcome
    tokens: int = 0  # admitted: the tokens it runs this step


WAIT, NO_ROOM = Admission(Outcome.WAIT), Admission(Outcome.NO_ROOM)


class Admitter:
    SHARE_PROBE = 32  # tokens compared to detect two waiting requests sharing an uncached prefix

    def __init__(self, mem: KVMemory) -> None:
        self.mem = mem
        self.swaps_in = 0

    def admit(self, r: Req, token_budget: int, reserve: int, computing: list[Req]) -> Admission:
        """Try r with token_budget tokens left this step and `reserve` pages kept back. computing:
        the requests whose uncached tokens run this step (an admitted new request joins them)."""
        if r.kv.is_swapped:
            return self._admit_swapped(r, token_budget, reserve)
        return self._admit_waiting(r, token_budget, reserve, computing)

    def _admit_waiting(self, r: Req, token_budget: int, reserve: int, computing: list[Req]) -> Admission:
        """Admit r from its longest cached prefix, unless it should wait or does not fit."""
        m = self.mem.match(r)
        if self._shares_uncached_prefix(r, m.matched_len, computing):
            return WAIT
        if not self.mem.admit(r, m, min(r.seq_len - m.matched_len, token_budget), reserve):
            return NO_ROOM
        computing.append(r)
        n = min(r.extend_len, token_budget)
        return Admission(Outcome.ADMITTED, r.retention.first_tokens(r.kv_len, n) if r.retention else n)

    def _admit_swapped(self, r: Req, token_budget: int, reserve: int) -> Admission:
        """Bring a swapped-out r back from host memory, if its pages fit."""
        n = min(r.seq_len - r.kv.swapped_len, token_budget)
        if self.mem.swap.pages_back(r, n) + reserve > self.mem.available:
            return NO_ROOM
        self.mem.swap.back(r)
        self.swaps_in += 1
        return Admission(Outcome.ADMITTED, n)

    def _shares_uncached_prefix(self, r: Req, matched: int, computing: list[Req]) -> bool:
        """A request still prefilling will compute r's next tokens: wait for them and hit the cache."""
        end = matched + self.SHARE_PROBE
        if r.seq_len < end + 1:
            return False
        probe = r.tokens(0, end)
        return any(a.namespace == r.namespace and a.seq_len > end and a.tokens(0, end) == probe for a in computing)

    def stats(self) -> dict[str, int]:
        return {"swaps_in": self.swaps_in}
