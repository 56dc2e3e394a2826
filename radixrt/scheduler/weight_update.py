"""A weight update in the scheduler: what it holds while the old weights finish their work.

Requests received before the UpdateWeights message are in flight: they finish on the old
weights (or are aborted at once with abort_all_requests). Requests received after it are
held, untouched, until the workers have loaded the new weights and the old KV is gone;
then they enter as if they had just arrived. The frontend sends its messages in order on
one socket, so "before" and "after" are exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from radixrt.messages import TokenizedRequest, UpdateWeights

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
