"""Priorities with SGLang's meaning (radixrt/settings/scheduling.py): a request's rank, the
admission order they impose, and which running requests a waiting one may preempt.

A rank is the priority turned into "larger goes first": the priority itself, its negation under
--schedule-low-priority-values-first, and LEAST for a request that sets none (SGLang gives it
the least important value). Without --enable-priority-scheduling every rank is 0 and the order
is the schedule policy's alone. With it, admission takes the highest rank first; within one rank
tenants share (tenants.py) and the schedule policy (lpm, fcfs) orders each tenant's requests.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixrt.messages import FinishReason
from radixrt.scheduler.req import Req
from radixrt.settings.scheduling import PRIORITY_DISABLED

LEAST = -(1 << 63)  # the rank of a request without a priority


@dataclass(frozen=True)
class Priorities:
    enabled: bool = False
    low_first: bool = False  # --schedule-low-priority-values-first
    threshold: int = 10  # --priority-scheduling-preemption-threshold
    abort_when_disabled: bool = False  # --abort-on-priority-when-disabled

    def rank(self, priority: int | None) -> int:
        if not self.enabled:
            return 0
        if priority is None:
            return LEAST
        return -priority if self.low_first else priority

    def refusal(self, priority: int | None) -> FinishReason | None:
        """SGLang's 503 for a priority sent to a server that runs none, when asked to refuse it."""
        if priority is not None and not self.enabled and self.abort_when_disabled:
            return FinishReason("abort", message=PRIORITY_DISABLED, status_code=503)
        return None

    def outranks(self, a: Req, b: Req) -> bool:
        """a's priority is higher than b's by more than the threshold: a may preempt b."""
        return self.enabled and a.rank - b.rank > self.threshold

    def victims(self, r: Req, running: list[Req]) -> list[Req]:
        """The running requests r may preempt, the first to go first: the lowest rank, and among
        equals the most recently admitted (SGLang's order)."""
        if not self.enabled:
            return []
        below = [v for v in running if self.outranks(r, v)]
        return sorted(below, key=lambda v: (v.rank, -v.admitted_at))
