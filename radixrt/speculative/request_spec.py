"""RequestSpec: one request's speculative decoding state, kept by the scheduler on its Req."""

from __future__ import annotations

from dataclasses import dataclass, field

from radixrt.messages import SpecCounts
from radixrt.speculative.draft_length import AcceptanceRate
from radixrt.speculative.ngram_index import SequenceLookup


@dataclass(eq=False)
class RequestSpec:
    off: str | None  # why it runs unspeculated (scheduler/speculation.UNSPECULATED); None: it may speculate
    lookup: SequenceLookup | None = None  # NGRAM: its own prompt and output, indexed
    record: AcceptanceRate = field(default_factory=AcceptanceRate)
    verify_ct: int = 0
    idle: int = 0  # decode steps in a row it was given no draft
    pending: int = 0  # drafts its entry in flight verifies
    branched: bool = False  # whether they form a tree (not a chain)
    checked_at: int = -1  # STANDALONE: the admission whose prefix's draft KV was checked

    def counts(self) -> SpecCounts:
        return SpecCounts(self.verify_ct, self.record.proposed, self.record.accepted)
