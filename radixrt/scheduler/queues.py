"""Queues: where each live request is (compiling its grammar, waiting, running), the batch slots,
the batch in flight, and the outputs not yet sent. The scheduler and its collaborators
(arrivals.py, step_results.py, lora_requests.py) share one Queues.

NOTE: preemption.py keeps a reference to `waiting`, so the lists are changed in place, never
replaced (the outbox and the batch in flight, which only these modules read, are swapped out).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from radixrt.messages import ReqOutput
from radixrt.scheduler.grammars import GrammarWaitlist
from radixrt.scheduler.req import Req


@dataclass
class Queues:
    grammars: GrammarWaitlist  # requests whose grammar compiles; they join `waiting` when it is ready
    max_running: int
    waiting: list[Req] = field(default_factory=list)
    running: list[Req] = field(default_factory=list)
    free_slots: list[int] = field(default_factory=list)
    freed_slots: list[int] = field(default_factory=list)  # to tell the worker with the next batch
    inflight: list[tuple[Req, int]] = field(default_factory=list)  # (request, tokens run) per entry of the batch
    outbox: list[ReqOutput] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.free_slots = list(range(self.max_running - 1, -1, -1))

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running and not self.grammars

    @property
    def queued(self) -> list[Req]:
        """The requests not yet running: waiting, or compiling their grammar."""
        return self.waiting + self.grammars.requests

    @property
    def live(self) -> list[Req]:
        return self.waiting + self.running + self.grammars.requests

    def find(self, rid: str) -> Req | None:
        return next((r for r in self.live if r.rid == rid), None)

    def seat(self, r: Req) -> None:
        """r has its pages: from the waiting queue into the running batch, in a free slot."""
        self.waiting.remove(r)
        r.slot = self.free_slots.pop()
        self.running.append(r)

    def unseat(self, r: Req) -> None:
        """r leaves the running batch; the worker hears of its slot with the next batch."""
        self.running.remove(r)
        self.free_slots.append(r.slot)
        self.freed_slots.append(r.slot)
        r.slot = None

    def take_outputs(self) -> list[ReqOutput]:
        out, self.outbox = self.outbox, []
        return out
