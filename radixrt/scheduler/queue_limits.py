"""QueueLimits: SGLang's bounded queue and request timeouts, and their counts.

- --max-queued-requests: a request arriving at a full queue (requests waiting to run, those
  compiling a grammar included) is answered with SGLang's 503. With priority scheduling the
  least important waiting request (the newest among equals) gets the 503 instead, when the
  newcomer strictly outranks it (SGLang 0.5.9's _abort_on_queued_limit).
- the waiting timeout ends a request that has not run within so many seconds of arriving; the
  running timeout one still unfinished so many seconds after it first ran (time spent retracted
  counts). Both end with SGLang's 503; the scheduler frees or caches their pages as for any
  finished request, and the frontend forgets their rids at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from radixrt.messages import FinishReason
from radixrt.scheduler.req import Req
from radixrt.settings.scheduling import OUTRANKED, QUEUE_FULL, RUNNING_TIMEOUT, WAITING_TIMEOUT

# why the scheduler refused or ended a request on its own (SchedulerStats.requests_rejected)
REJECTIONS = ("queue_full", "outranked", "priority_disabled", "waiting_timeout", "running_timeout")


def unavailable(message: str) -> FinishReason:
    return FinishReason("abort", message=message, status_code=503)


@dataclass
class QueueLimits:
    max_queued: int | None = None
    waiting_timeout: float | None = None
    running_timeout: float | None = None
    priorities: bool = False  # --enable-priority-scheduling: a full queue drops its least important request
    rejected: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REJECTIONS, 0))

    def on_arrival(self, r: Req, queued: list[Req]) -> tuple[Req, FinishReason] | None:
        """r arrives at a queue holding `queued`: None when it fits, else the request that ends
        (r itself, or under priorities a waiting one r outranks) and its 503."""
        if self.max_queued is None or len(queued) + 1 <= self.max_queued:
            return None
        if self.priorities and queued:
            least = max(queued, key=lambda q: (-q.rank, q.arrived_at))
            if r.rank > least.rank:
                self.rejected["outranked"] += 1
                return least, unavailable(OUTRANKED)
        self.rejected["queue_full"] += 1
        return r, unavailable(QUEUE_FULL)

    def expired(self, waiting: list[Req], running: list[Req], now: float) -> list[tuple[Req, FinishReason]]:
        """The requests past a timeout at `now`, each with its 503. A retracted request waiting to
        run again is on the running clock (it has run)."""
        out = []
        for r in waiting + running:
            if r.started_at is None:
                late = self.waiting_timeout is not None and now - r.arrived_at > self.waiting_timeout
                kind, message = "waiting_timeout", WAITING_TIMEOUT
            else:
                late = self.running_timeout is not None and now - r.started_at > self.running_timeout
                kind, message = "running_timeout", RUNNING_TIMEOUT
            if late:
                self.rejected[kind] += 1
                out.append((r, unavailable(message)))
        return out

    @property
    def timed(self) -> bool:
        return self.waiting_timeout is not None or self.running_timeout is not None
