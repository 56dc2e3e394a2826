"""How many drafts each decoding request verifies in a step, from measured cost and acceptance.

A step's time is close to linear in the work it runs: t = c0 + c1 * W, where c0 is reading
the weights once and c1 a unit of per-token work. A token attending p positions is
1 + a * p units, a being the model's attention FLOPs per position over its other per-token
FLOPs (worker/tier_probe.attention_per_position), so a draft of a request deep into a long
context costs more than one near the start. StepCost fits c0 and c1 from the decode steps the
scheduler has timed, decayed so that it follows the machine. A request whose drafts are each
accepted with probability a_r, given the ones before it (a geometric chain), gains a_r^j
expected tokens from its j-th draft, which costs c1 * w_r. Adding a draft raises the step's
throughput (tokens out per second) iff gain * t > c1 * w_r * out for the step as planned so
far. Drafts are added greedily, the best gain per cost first; gains fall with j, so the
greedy plan is the best one for this model.

At batch 1 the step is weight-bound (c1 small against c0): drafts with modest acceptance
pay. At a large batch the step is compute-bound (c1 * out / t near 1): only drafts almost
sure to be accepted would, and at a = 1 exactly none pays any more, so speculation turns
itself off there. The acceptance of a request is its own record, smoothed toward the
server's (AcceptanceRate).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

DECAY = 0.97  # per observed step: the fit follows about the last 30 steps
PRIOR_SLOPE = 0.02  # c1 / c0 before any measurement: a token costs 2% of a one-token step
PRIOR_WEIGHT = 1.0  # the prior slope's weight, in observed steps ...
PRIOR_SPREAD = 1.0  # ... that many tokens either side of the mean
PRIOR_ACCEPT = 0.5  # a request's acceptance before anything is verified
ACCEPT_PSEUDO = 4.0  # drafts' worth of the server's rate in a request's estimate
EXPLORE_AFTER = 16  # a request given no draft this many steps in a row gets one, to measure again


@dataclass
class StepCost:
    """Least-squares fit of seconds = c0 + c1 * tokens over decayed observations. The slope is
    pulled toward a prior (PRIOR_SLOPE * the mean step) with the weight of PRIOR_WEIGHT steps
    spread PRIOR_SPREAD tokens either side, so that steps which all ran as many tokens (no
    drafts yet) do not leave it undefined, and steps that differ soon outweigh it."""

    w: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        if seconds <= 0:
            return
        self.w, self.sx, self.sy = self.w * DECAY + 1, self.sx * DECAY + tokens, self.sy * DECAY + seconds
        self.sxx, self.sxy = self.sxx * DECAY + tokens * tokens, self.sxy * DECAY + tokens * seconds

    @property
    def known(self) -> bool:
        return self.w > 0

    def coefficients(self) -> tuple[float, float]:
        """(c0, c1), both >= 0 (c1 > 0: drafts are never free)."""
        mx, my = self.sx / self.w, self.sy / self.w
        spread = max(self.sxx - self.w * mx * mx, 0.0)  # the observations' weighted squared deviations
        prior = PRIOR_WEIGHT * PRIOR_SPREAD**2
        c1 = (self.sxy - self.w * mx * my + prior * PRIOR_SLOPE * my) / (spread + prior)
        c1 = max(c1, 1e-3 * my)
        return max(my - c1 * mx, 0.0), c1

    def seconds(self, tokens: int) -> float:
        c0, c1 = self.coefficients()
        return c0 + c1 * tokens


@dataclass
class AcceptanceRate:
    """Accepted over proposed drafts: one request's, or the server's."""

    proposed: int = 0
    accepted: int = 0

    def add(self, proposed: int, accepted: int) -> None:
        self.proposed += proposed
        self.accepted += accepted

    @property
    def rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    def smoothed(self, server: AcceptanceRate) -> float:
        """This request's rate, with ACCEPT_PSEUDO drafts at the server's (PRIOR_ACCEPT before any)."""
        prior = server.rate if server.proposed else PRIOR_ACCEPT
        return (self.accepted + ACCEPT_PSEUDO * prior) / (self.proposed + ACCEPT_PSEUDO)


def token_work(positions: int, attention_per_position: float) -> float:
    """The work units of one token that attends `positions` positions."""
    return 1.0 + attention_per_position * positions


def plan_drafts(cost: StepCost, accept: list[float], caps: list[int], work: list[float],
                fixed_work: float = 0.0) -> list[int]:
    """Drafts per request for one step: accept[i] is request i's acceptance, caps[i] the most it may
    verify (context, length, pages), work[i] what one of its tokens costs (token_work);
    fixed_work: the step's plain tokens' work (its decodes and prefill chunks).
    Unmeasured cost: no drafts (the caller explores)."""
    n = len(accept)
    plan = [0] * n
    if not cost.known or n == 0:
        return plan
    c0, c1 = cost.coefficients()
    out, t = float(n), c0 + c1 * fixed_work
    # (-gain per unit of work of request i's next draft, gain, i): its first draft gains accept[i]
    heap = [(-a / work[i], a, i) for i, a in enumerate(accept) if caps[i] > 0 and a > 0]
    heapq.heapify(heap)
    while heap:
        _, gain, i = heapq.heappop(heap)
        if gain * t <= c1 * work[i] * out:
            continue  # it does not pay; a cheaper request's draft still may
        plan[i] += 1
        out, t = out + gain, t + c1 * work[i]
        if plan[i] < caps[i]:
            heapq.heappush(heap, (-gain * accept[i] / work[i], gain * accept[i], i))
    return plan
