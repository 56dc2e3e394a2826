"""A weight update in the scheduler: what it holds while the old weights finish their work,
and what the new weights' arrival does to the KV the scheduler keeps.

Requests received before the UpdateWeights message are in flight: they finish on the old
weights (or are aborted at once with abort_all_requests). Requests received after it are
held, untouched, until the workers have loaded the new weights and the old KV is gone;
then they enter as if they had just arrived. The frontend sends its messages in order on
one socket, so "before" and "after" are exact.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from radixrt.messages import FinishReason, ReqOutput, TokenizedRequest, UpdateWeights, WeightsLoaded, WeightsUpdateReply
from radixrt.scheduler.kv_memory import KVMemory

logger = logging.getLogger(__name__)
ABORTED_FOR_UPDATE = "aborted: the weights are being updated (abort_all_requests)"


@dataclass
class PendingUpdate:
    msg: UpdateWeights
    held: list[TokenizedRequest] = field(default_factory=list)  # arrived during the update, in order

    def release(self, rid: str) -> TokenizedRequest | None:
        """Take the held request rid out (it was aborted), or None when none is held under it."""
        for i, m in enumerate(self.held):
            if m.rid == rid:
                return self.held.pop(i)
        return None


class WeightUpdates:
    """The update under way (at most one), the requests it holds, and how many updates succeeded.
    The scheduler ends its own requests for abort_all_requests and lets the held ones in."""

    def __init__(self, mem: KVMemory) -> None:
        self.mem = mem
        self.pending: PendingUpdate | None = None  # waiting for the old weights' requests
        self.done = 0

    def begin(self, msg: UpdateWeights) -> WeightsUpdateReply | None:
        """From now on new requests are held. Returns a refusal when an update is already under way."""
        if self.pending is not None:
            return WeightsUpdateReply(msg.query_id, False, "another weight update is in progress")
        self.pending = PendingUpdate(msg)
        return None

    def hold(self, msg: TokenizedRequest) -> bool:
        """Keep msg, unchecked, for the new weights when an update is under way."""
        if self.pending is None:
            return False
        self.pending.held.append(msg)
        return True

    def abort_held(self, rid: str) -> ReqOutput | None:
        """The answer to aborting rid when it is held here (it leaves), else None."""
        msg = self.pending.release(rid) if self.pending is not None else None
        if msg is None:
            return None
        return ReqOutput(rid, [], FinishReason("abort", message="aborted by client"), len(msg.input_ids))

    def finish(self, loaded: WeightsLoaded) -> tuple[WeightsUpdateReply, list[TokenizedRequest]]:
        """The workers answered. On success every page computed with the old weights leaves the
        device and host tiers, and the disk tier moves to the new weights' directory (the old one
        stays on disk for a rollback). Returns the reply and the held requests, in arrival order:
        either way they enter now, after the reply."""
        upd, self.pending = self.pending, None
        assert upd is not None, "WeightsLoaded without a pending update"
        if loaded.success:
            self.mem.flush()
            if self.mem.tiers is not None and self.mem.tiers.disk is not None:  # "": the tier turned off
                self.mem.tiers.disk_tier.switch(loaded.disk_dir, loaded.disk_pages)
            self.done += 1
        else:
            logger.error("weight update from %s refused: %s", upd.msg.model_path, loaded.message)
        reply = WeightsUpdateReply(upd.msg.query_id, loaded.success, loaded.message, loaded.weights_fingerprint,
                                   len(upd.held))
        return reply, upd.held

    def stats(self) -> dict[str, int]:
        return {"weight_updates": self.done, "weight_update_pending": int(self.pending is not None),
                "held_for_weight_update": len(self.pending.held) if self.pending is not None else 0}
