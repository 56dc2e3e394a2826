"""AdmissionBudget: how many free pages to hold back for the running requests' growth.

Admitting a request costs its prompt's pages now and its output's pages later.
Reserving every running request's full max_new_tokens wastes memory (most stop
early); reserving nothing thrashes (admit, run out, retract, re-admit). As
SGLang does, reserve a ratio of the remaining tokens that decays while things
go well and jumps after a retraction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from radixrt.scheduler.req import Req


@dataclass
class AdmissionBudget:
    page_size: int
    ratio: float = 0.7
    min_ratio: float = 0.15
    decay: float = 0.002
    retract_bump: float = 0.3

    def reserve_pages(self, reqs: list[Req]) -> int:
        tokens = sum(r.growth_tokens for r in reqs) * self.ratio
        return math.ceil(tokens / self.page_size)

    def on_step(self) -> None:
        self.ratio = max(self.min_ratio, self.ratio - self.decay)

    def on_retract(self) -> None:
        self.ratio = min(1.0, self.ratio + self.retract_bump)
