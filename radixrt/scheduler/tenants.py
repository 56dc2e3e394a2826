"""Tenants in the scheduler: who a request counts for, the fair order of admission among them,
their shares of a step's prefill tokens, their KV quotas in pages, and their figures.

A tenant is the one an API key names (--api-keys-file), else the request's cache_salt (""
for requests without one). Under contention, admission shares the running slots among the
tenants with waiting work by weight: the next request admitted is the head of the tenant
holding the fewest slots per unit of weight (a weighted round robin over slots), so one
tenant's thousand queued requests cannot starve another's one. Priority comes first (a tenant
is picked among those whose next request has the highest rank); within a tenant the schedule
policy's order holds. A step's prefill tokens are shared the same way when several tenants
have prompt tokens to run: each gets at most its weighted part of the step's budget.

Figures per tenant are labelled by name for at most MAX_LABELS tenants (the keys file's
first, then the first seen); the rest add up under "other", so /metrics stays bounded.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from collections.abc import Iterator

from radixrt.messages import TokenizedRequest
from radixrt.scheduler.req import Req
from radixrt.settings.scheduling import TenantSpec

MAX_LABELS = 16
OTHER = "other"
FIGURES = ("requests", "prompt_tokens", "cached_tokens", "rejected")  # counted as they happen
NOW = ("waiting", "running", "cached_pages")  # read when the figures are asked for


class Tenants:
    def __init__(self, table: dict[str, TenantSpec], default_quota: float, num_pages: int) -> None:
        """table: the keys file's tenants by name; default_quota: --tenant-kv-quota."""
        self.table, self.default_quota, self.num_pages = table, default_quota, num_pages
        self.labels: dict[str, str] = {name: name for name in list(table)[:MAX_LABELS]}
        self.figures: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(FIGURES, 0))

    @staticmethod
    def name_of(msg: TokenizedRequest) -> str:
        return msg.tenant if msg.tenant is not None else (msg.namespace.salt or "")

    def weight(self, tenant: str) -> float:
        spec = self.table.get(tenant)
        return spec.weight if spec is not None else 1.0

    def quota_pages(self, tenant: str) -> int | None:
        """The cached pages tenant may hold before its own go first (None: no quota)."""
        spec = self.table.get(tenant)
        fraction = spec.kv_quota if spec is not None and spec.kv_quota is not None else self.default_quota
        return None if fraction >= 1 else max(1, math.floor(fraction * self.num_pages))

    @property
    def has_quotas(self) -> bool:
        return self.default_quota < 1 or any(s.kv_quota is not None and s.kv_quota < 1 for s in self.table.values())

    # -- fair order ----------------------------------------------------------------

    def order(self, ordered: list[Req], running: list[Req]) -> FairOrder:
        return FairOrder(ordered, running, self.weight)

    def shares(self, pending: set[str]) -> dict[str, float] | None:
        """Each pending tenant's fraction of a step's prefill budget (None: one tenant, no sharing)."""
        if len(pending) < 2:
            return None
        total = sum(self.weight(t) for t in pending)
        return {t: self.weight(t) / total for t in pending}

    # -- figures ---------------------------------------------------------------------

    def label(self, tenant: str) -> str:
        if tenant not in self.labels and len(self.labels) < MAX_LABELS:
            self.labels[tenant] = tenant or "default"
        return self.labels.get(tenant, OTHER)

    def count(self, tenant: str, figure: str, n: int = 1) -> None:
        self.figures[self.label(tenant)][figure] += n

    def stats(self, waiting: list[Req], running: list[Req], cached_pages: dict[str, int]) -> dict[str, dict[str, int]]:
        """SchedulerStats' tenant_* fields: figure -> label -> value; the counters, then the
        requests waiting and running and the cached pages held now."""
        out: dict[str, dict[str, int]] = {f"tenant_{f}": defaultdict(int) for f in FIGURES + NOW}
        for label, counts in self.figures.items():
            for figure, n in counts.items():
                out[f"tenant_{figure}"][label] += n
        for figure, reqs in (("waiting", waiting), ("running", running)):
            for r in reqs:
                out[f"tenant_{figure}"][self.label(r.tenant)] += 1
        for tenant, pages in cached_pages.items():
            out["tenant_cached_pages"][self.label(tenant)] += pages
        return {figure: dict(by_label) for figure, by_label in out.items()}


class FairOrder:
    """The waiting requests in admission order, decided one at a time: the next is the head of
    the tenant whose head has the highest rank, and among those the one holding the fewest
    running slots per unit of weight (ties: the earlier in the policy's order). Call `took`
    for each request admitted, so its tenant's count grows."""

    def __init__(self, ordered: list[Req], running: list[Req], weight) -> None:
        self._queues: dict[str, list[Req]] = defaultdict(list)
        for r in reversed(ordered):  # each tenant's requests in policy order, popped from the end
            self._queues[r.tenant].append(r)
        self._weight = weight
        self._slots: dict[str, int] = defaultdict(int)
        for r in running:
            self._slots[r.tenant] += 1
        self._pos = {id(r): i for i, r in enumerate(ordered)}
        self._heap = [self._entry(t) for t in self._queues]
        heapq.heapify(self._heap)

    def _entry(self, tenant: str) -> tuple[int, float, int, str]:
        head = self._queues[tenant][-1]
        return (-head.rank, self._slots[tenant] / self._weight(tenant), self._pos[id(head)], tenant)

    def __iter__(self) -> Iterator[Req]:
        while self._heap:
            tenant = heapq.heappop(self._heap)[3]
            r = self._queues[tenant].pop()
            if self._queues[tenant]:
                heapq.heappush(self._heap, self._entry(tenant))
            yield r

    def took(self, r: Req) -> None:
        """r was admitted: its tenant holds one more slot (its queued requests' place moves back)."""
        self._slots[r.tenant] += 1
        for i, entry in enumerate(self._heap):
            if entry[3] == r.tenant:
                self._heap[i] = self._entry(r.tenant)
                heapq.heapify(self._heap)
                break
