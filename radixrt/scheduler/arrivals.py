"""Arrivals: the scheduler's door. A request comes in (checked by intake.py, resolved into its LoRA
adapter's namespace, refused at a full queue, pinned) and waits for its grammar or for admission;
while the weights change it is held, untouched (weight_update.py). Requests also leave here
before they run: aborted by the client, or answered when the frontend's message did not decode.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from radixrt.errors import from_validation
from radixrt.messages import (
    FinishReason,
    ReqOutput,
    TokenizedRequest,
    UpdateWeights,
    WeightsLoaded,
    WeightsUpdateReply,
)
from radixrt.scheduler.bad_input import bad_request, rejection, rid_of
from radixrt.scheduler.intake import Intake
from radixrt.scheduler.kv_memory import KVMemory
from radixrt.scheduler.lora_requests import LoraRequests
from radixrt.scheduler.priorities import Priorities
from radixrt.scheduler.queue_limits import QueueLimits
from radixrt.scheduler.queues import Queues
from radixrt.scheduler.req import Req
from radixrt.scheduler.tenants import Tenants
from radixrt.scheduler.weight_update import ABORTED_FOR_UPDATE, WeightUpdates

logger = logging.getLogger(__name__)


class Arrivals:
    def __init__(self, queues: Queues, intake: Intake, lora: LoraRequests, mem: KVMemory, weights: WeightUpdates,
                 priorities: Priorities, limits: QueueLimits, tenants: Tenants,
                 finish: Callable[[Req, FinishReason], None]) -> None:
        """finish: the scheduler's, which ends a request wherever it is."""
        self.queues, self.intake, self.lora, self.mem, self.weights = queues, intake, lora, mem, weights
        self.priorities, self.limits, self.tenants, self.finish = priorities, limits, tenants, finish

    def add(self, msg: TokenizedRequest) -> None:
        """Queue msg, or answer it with a 400 abort when the model cannot run it. During a weight
        update it waits, unchecked, for the new weights."""
        if self.weights.hold(msg):
            return
        msg = self.lora.resolve(msg)  # in its adapter's namespace, or its 400
        r = self.intake.accept(msg) if isinstance(msg, TokenizedRequest) else msg
        if not isinstance(r, ReqOutput):
            r.tenant, r.rank, r.arrived_at = self.tenants.name_of(msg), self.priorities.rank(msg.priority), time.monotonic()
            self.tenants.count(r.tenant, "requests")
            if (why := self.mem.pins.refusal(r)) is not None:
                logger.error("refused request %s: %s", r.rid, why)
                r = rejection(r.rid, why, r.prompt_len)
        if isinstance(r, ReqOutput):  # refused
            self.queues.outbox.append(r)
            return
        if not self._queue_takes(r, msg.priority):
            return
        if r.pin_ttl is not None:
            self.mem.pins.pin(r, time.monotonic())
        if r.sampling.constraint is not None:
            self.queues.grammars.add(r)  # it joins the waiting queue once its matcher is ready
        else:
            self.queues.waiting.append(r)

    def _queue_takes(self, r: Req, priority: int | None) -> bool:
        """SGLang's refusals at the queue: a priority on a server without priorities (when asked),
        and a full queue (r, or under priorities a waiting request r outranks, gets the 503)."""
        refused = self.priorities.refusal(priority)
        if refused is not None:
            self.limits.rejected["priority_disabled"] += 1
            self._answer_unqueued(r, refused)
            return False
        full = self.limits.on_arrival(r, self.queues.queued)
        if full is None:
            return True
        ended, reason = full
        if ended is r:
            self._answer_unqueued(r, reason)
            return False
        self.tenants.count(ended.tenant, "rejected")
        self.finish(ended, reason)
        return True

    def _answer_unqueued(self, r: Req, reason: FinishReason) -> None:
        logger.warning("refused request %s: %s", r.rid, reason.message)
        self.tenants.count(r.tenant, "rejected")
        r.finish = reason
        self.queues.outbox.append(ReqOutput(r.rid, [], reason, r.prompt_len, 0))

    def take_compiled(self) -> None:
        """Requests whose grammar is compiled join the waiting queue; a refused grammar ends its request."""
        ready, ended = self.queues.grammars.take_ready()
        for r, reason in ended:
            self.finish(r, reason)
        self.queues.waiting.extend(ready)

    def reject_undecodable(self, raw: bytes, error: Exception) -> None:
        """A frontend message that did not decode: if it names a string rid, answer that rid
        with a 400 abort (a request held under it leaves too, as the frontend forgets it)."""
        why = f"malformed request: {from_validation(error, what='message').message}"
        rid = rid_of(raw)
        logger.error("undecodable message from the frontend (%d bytes, rid %r): %s", len(raw), rid, why)
        if rid is None:
            return
        held = self.queues.find(rid)
        if held is None:
            self.queues.outbox.append(rejection(rid, why))
        else:
            self.finish(held, bad_request(why))

    def abort(self, rid: str) -> None:
        held_for_update = self.weights.abort_held(rid)
        if held_for_update is not None:
            self.queues.outbox.append(held_for_update)
            return
        r = self.queues.find(rid)
        if r is not None:
            self.finish(r, FinishReason("abort", message="aborted by client"))

    # -- weight updates (weight_update.py) -----------------------------------------------------

    def begin_weight_update(self, msg: UpdateWeights) -> WeightsUpdateReply | None:
        """From now on new requests wait; with abort_all_requests every request in the system ends
        now. Returns a refusal when an update is already under way."""
        refusal = self.weights.begin(msg)
        if refusal is None and msg.abort_all_requests:
            for r in self.queues.live:
                self.finish(r, FinishReason("abort", message=ABORTED_FOR_UPDATE))
        return refusal

    def finish_weight_update(self, loaded: WeightsLoaded) -> WeightsUpdateReply:
        """The workers answered: the old KV goes (on success), and the held requests enter, after the reply."""
        reply, held = self.weights.finish(loaded)
        for msg in held:
            self.add(msg)
        return reply
