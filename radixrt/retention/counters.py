"""RetentionCounters: the bounded-KV policies' counters, for the scheduler's stats.

Requests admitted per policy, pages dropped, the most pages a request under a
policy held after a step, and the retained share of the running policy requests'
computed KV. The scheduler calls it with its requests (RetainedReq).
"""

from __future__ import annotations

from typing import Protocol

from radixrt.retention.drop_plan import RetainedKV
from radixrt.retention.policies import RetentionBudget
from radixrt.settings.retention import RetentionPolicy


class RetainedReq(Protocol):
    """What the counters read of a request (scheduler/req.py's Req)."""

    retention: RetentionBudget | None  # None: it keeps all its KV
    kv: RetainedKV

    @property
    def kv_len(self) -> int:
        """Tokens whose KV it has computed, those dropped included."""
        ...


class RetentionCounters:
    def __init__(self) -> None:
        self.requests = {p.value: 0 for p in RetentionPolicy}  # admitted requests per policy
        self.dropped_pages = 0
        self.peak_pages = 0  # the most pages a request under a policy held after a step

    def count_request(self, r: RetainedReq) -> None:
        policy = r.retention.policy if r.retention is not None else RetentionPolicy.NONE
        self.requests[policy.value] += 1

    def after_growth(self, r: RetainedReq, dropped_pages: int) -> None:
        if r.retention is not None:
            self.dropped_pages += dropped_pages
            self.peak_pages = max(self.peak_pages, len(r.kv.pages))

    def stats(self, running: list[RetainedReq]) -> dict[str, int | float | dict[str, int]]:
        """Counters, and the retained share of the running policy requests' computed KV (1.0: none)."""
        bounded = [r for r in running if r.retention is not None]
        computed = sum(r.kv_len for r in bounded)
        retained = sum(r.kv.kv_len for r in bounded) / computed if computed else 1.0
        return {
            "kv_retention_dropped_pages": self.dropped_pages,
            "kv_retention_peak_pages": self.peak_pages,
            "kv_retention_retained_fraction": retained,
            "kv_retention_requests": dict(self.requests),
        }
