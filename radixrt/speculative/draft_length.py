"""How many drafts each decoding request verifies in a step, from measured cost and acceptance.

A step's time is close to linear in the work it runs: t = c0 + c1 * W + c2 * D, where c0 is
reading the weights once, c1 a unit of a plain token's work and c2 one of a draft's (W and D:
the work of the step's plain tokens and of its drafts). A token attending p positions is
1 + a * p units, a being the model's attention FLOPs per position over its other per-token
FLOPs (worker/tier_probe.attention_per_position), so a draft of a request deep into a long
context costs more than one near the start. StepCost fits c0, c1 and c2 from the decode steps
the scheduler has timed, decayed so that it follows the machine. A request whose drafts are each
accepted with probability a_r, given the ones before it (a geometric chain), gains a_r^j
expected tokens from its j-th draft, which costs c2 * w_r. Adding a draft raises the step's
throughput (tokens out per second) iff gain * t > c2 * w_r * out for the step as planned so
far; a draft is added only with DRAFT_MARGIN to spare. Drafts are added greedily, the best
gain per cost first; gains fall with j, so the greedy plan is the best one for this model.

At batch 1 the step is weight-bound (c1 small against c0): drafts with modest acceptance
pay. At a large batch the step is compute-bound (c1 * out / t near 1): only drafts almost
sure to be accepted would, and at a = 1 exactly none pays any more, so speculation turns
itself off there. The acceptance of a request is its own record, smoothed toward the
server's (AcceptanceRate).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

DECAY = 0.97  # per observed step: the fit follows about the last 30 steps
PRIOR_SLOPE = 0.02  # c1 / c0 before any measurement: a token costs 2% of a one-token step
PRIOR_WEIGHT = 1.0  # the prior slope's weight, in observed steps ...
PRIOR_SPREAD = 1.0  # ... that many tokens either side of the mean
PRIOR_ACCEPT = 0.5  # a request's acceptance before anything is verified
ACCEPT_PSEUDO = 4.0  # drafts' worth of the server's rate in a request's estimate
# a draft must promise this much more throughput than it costs: near break-even, what the model
# leaves out (the frontend streaming more tokens per step, noise in the fit) decides, and loses
DRAFT_MARGIN = 1.1
EXPLORE_AFTER = 16  # a request given no draft this many steps in a row gets one, to measure again


@dataclass
class StepCost:
    """Least-squares fit of seconds = c0 + c1 * plain + c2 * drafted over decayed observations:
    plain is the work of the step's plain tokens, drafted that of its drafts, whose unit cost
    is fitted apart (a draft row may cost more than a decode row: it leaves the decode kernels'
    fast paths, and its sampling and acceptance run beside the plain sampling). Both slopes are
    pulled toward a prior (PRIOR_SLOPE * the mean step) with the weight of PRIOR_WEIGHT steps
    spread PRIOR_SPREAD units either side, so that steps which all ran as much (no drafts yet)
    do not leave them undefined, and steps that differ soon outweigh it."""

    # decayed sums of 1, x1, x2, y and their products (x1: plain work, x2: drafted work, y: seconds)
    s: list[float] = field(default_factory=lambda: [0.0] * 9)

    def observe(self, plain: float, drafted: float, seconds: float) -> None:
        if seconds <= 0:
            return
        terms = (1.0, plain, drafted, seconds, plain * plain, plain * drafted, drafted * drafted, plain * seconds,
                 drafted * seconds)
        self.s = [v * DECAY + t for v, t in zip(self.s, terms)]

    @property
    def known(self) -> bool:
        return self.s[0] > 0

    def coefficients(self) -> tuple[float, float, float]:
        """(c0, c1, c2), all >= 0 (c1, c2 > 0: no token is free)."""
        w, sx1, sx2, sy, s11, s12, s22, s1y, s2y = self.s
        m1, m2, my = sx1 / w, sx2 / w, sy / w
        prior, slope = PRIOR_WEIGHT * PRIOR_SPREAD**2, PRIOR_SLOPE * my
        # the centered normal equations with the prior on both slopes: [[a, b], [b, d]] @ (c1, c2) = (e, f)
        a, b, d = s11 - w * m1 * m1 + prior, s12 - w * m1 * m2, s22 - w * m2 * m2 + prior
        e, f = s1y - w * m1 * my + prior * slope, s2y - w * m2 * my + prior * slope
        det = a * d - b * b
        c1, c2 = (e * d - b * f) / det, (a * f - b * e) / det
        c1, c2 = max(c1, 1e-3 * my), max(c2, 1e-3 * my)
        return max(my - c1 * m1 - c2 * m2, 0.0), c1, c2


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
    c0, c1, c2 = cost.coefficients()
    out, t = float(n), c0 + c1 * fixed_work
    # (-gain per unit of work of request i's next draft, gain, i): its first draft gains accept[i]
    heap = [(-a / work[i], a, i) for i, a in enumerate(accept) if caps[i] > 0 and a > 0]
    heapq.heapify(heap)
    while heap:
        _, gain, i = heapq.heappop(heap)
        if gain * t <= DRAFT_MARGIN * c2 * work[i] * out:
            continue  # it does not pay; a cheaper request's draft still may
        plan[i] += 1
        out, t = out + gain, t + c2 * work[i]
        if plan[i] < caps[i]:
            heapq.heappush(heap, (-gain * accept[i] / work[i], gain * accept[i], i))
    return plan
