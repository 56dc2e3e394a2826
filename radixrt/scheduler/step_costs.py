"""StepCosts: the worker's measured times, taken before its result is applied, fed to the cost
models that read them: each kind of tier move (tier_costs.py), the step's seconds for the
prefill budget (step_budget.py), a prefill chunk's seconds by the positions its tokens attended
(tier_costs.py), and a decode-only step's seconds by its work, drafts included (speculation.py)."""

from __future__ import annotations

from radixrt.messages import BatchResult
from radixrt.scheduler.req import Req
from radixrt.scheduler.speculation import Speculator
from radixrt.scheduler.step_budget import StepBudget
from radixrt.scheduler.tier_costs import TierCosts


class StepCosts:
    def __init__(self, tier_costs: TierCosts, step_budget: StepBudget, spec: Speculator) -> None:
        self.tier_costs, self.step_budget, self.spec = tier_costs, step_budget, spec
        self.tier_move_seconds = 0.0

    def observe(self, batch: BatchResult, inflight: list[tuple[Req, int]]) -> None:
        """batch's times; inflight: its (request, tokens run) per entry, before the batch is applied
        (a request's kv.kv_len is where its entry's rows start)."""
        for t in batch.move_times:
            self.tier_move_seconds += t.seconds
            self.tier_costs.observe_moves(t.kind, t.pages, t.seconds)
        self.step_budget.observe([(r.kv.kv_len, n) for r, n in inflight], batch.forward_seconds)
        if any(n > 1 for _, n in inflight):
            tokens = sum(n for _, n in inflight)
            attended = sum(n * r.kv.kv_len + n * (n + 1) // 2 for r, n in inflight)
            self.tier_costs.observe_prefill(tokens, batch.forward_seconds, attended)
        elif inflight:  # decodes only: the step's cost by its work, drafts included (speculation.py)
            self.spec.observe_step(inflight, batch.forward_seconds)
