"""The draft-length model: the step cost fit, and the plan it makes from cost and acceptance."""

from __future__ import annotations

import pytest

from radixrt.speculative.draft_length import (
    AcceptanceRate,
    StepCost,
    plan_drafts,
    token_work,
)

pytestmark = pytest.mark.unit


def fitted(c0: float, c1: float, works: list[float], c2: float | None = None) -> StepCost:
    """Steps of these plain works, each once without drafts and once with half as much drafted."""
    cost = StepCost()
    c2 = c1 if c2 is None else c2
    for w in works * 10:
        cost.observe(w, 0, c0 + c1 * w)
        cost.observe(w, w / 2, c0 + c1 * w + c2 * w / 2)
    return cost


def test_the_fit_recovers_a_linear_step_cost_with_its_own_draft_slope():
    c0, c1, c2 = fitted(0.02, 0.001, [4, 9, 16, 30], c2=0.003).coefficients()
    assert c0 == pytest.approx(0.02, rel=0.05) and c1 == pytest.approx(0.001, rel=0.05)
    assert c2 == pytest.approx(0.003, rel=0.05)


def test_a_fit_without_spread_takes_the_prior_slopes():
    cost = StepCost()
    for _ in range(10):
        cost.observe(8, 0, 0.028)
    c0, c1, c2 = cost.coefficients()
    assert c1 > 0 and c2 > 0 and c0 + 8 * c1 == pytest.approx(0.028, rel=1e-6)


def test_weight_bound_steps_draft_up_to_the_cap_and_compute_bound_ones_do_not():
    weight_bound = fitted(0.05, 0.0005, [1, 3, 6, 9])
    assert plan_drafts(weight_bound, [0.8], [7], [1.0], 1.0) == [7]
    compute_bound = fitted(0.001, 0.01, [16, 40, 80])
    assert plan_drafts(fitted(0.05, 0.0005, [1, 3, 6, 9], c2=0.05), [0.8], [7], [1.0], 1.0) == [0]  # costly drafts
    assert plan_drafts(compute_bound, [0.8] * 16, [7] * 16, [1.0] * 16, 16.0) == [0] * 16


def test_better_acceptance_and_cheaper_tokens_get_the_drafts_first():
    cost = fitted(0.05, 0.002, [8, 16, 30, 40])
    plan = plan_drafts(cost, [0.9, 0.5, 0.9], [7, 7, 7], [1.0, 1.0, 3.0], 8.0)
    assert plan[0] > plan[1] and plan[0] > plan[2]
    assert plan_drafts(StepCost(), [0.9], [7], [1.0]) == [0]  # nothing measured yet


def test_a_request_s_acceptance_leans_on_the_server_s_until_its_own_record_grows():
    server, own = AcceptanceRate(90, 9), AcceptanceRate()
    assert own.smoothed(server) == pytest.approx(0.1)
    own.add(40, 40)
    assert own.smoothed(server) == pytest.approx((40 + 4 * 0.1) / 44)
    assert token_work(100, 0.01) == pytest.approx(2.0)
