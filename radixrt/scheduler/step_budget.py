"""StepBudget: how many prompt tokens a step may prefill, so that long prompts cannot stall the
requests that are decoding.

SGLang's two limits hold: --chunked-prefill-size caps one request's chunk, --max-prefill-tokens
a step's total. On top, while requests that stream decode, a step's prefill is cut so that the
step is predicted to take at most --max-decode-slowdown (X) times a decode-only step: each
streamed request then sees its next token at most X times later than it would without the prompts,
and a long prompt is prefilled over several steps instead (its TTFT grows to about X / (X - 1)
times its own prefill time while decodes run; nothing is cut when none do). A request answered
in one piece (no stream: an offline batch, a non-streaming /generate) has no pace a client
sees, only its end, which cutting the prompts beside it would delay: its decodes cut nothing
(SmolLM2's 16 x 3,000-token W6 took 1.5x vLLM's time when they did). Only prompts
whose uncached part is longer than LONG_PROMPT are cut; shorter ones (a question after a
cached document, too) run whole, and what they spend leaves less for the long ones.

The prediction is a line fitted to the recent steps (StepCost): seconds = fixed + per_work *
work, where a token's work is 1 + attention_per_position * (positions it attends), the unit
tier_costs.py uses. The least-squares fit over decayed sums follows the machine's load; until
it has seen steps of different sizes it predicts nothing and no step is cut.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from radixrt.scheduler.req import Req

STEP_DECAY = 0.02  # about the last 50 steps
MIN_STEPS = 8  # steps observed before the fit is used
MIN_CHUNK = 16  # a cut step still prefills this many tokens, so a prompt always progresses
# Prompts with at most this many uncached tokens are never cut: their whole prefill costs a few decode steps,
# and admitting them at once keeps a batch's throughput (they spend the cadence's budget all the same)
LONG_PROMPT = 1024


@dataclass
class StepCost:
    """A decayed least-squares line through (work, seconds) of recent steps."""

    n: float = 0.0
    sw: float = 0.0
    ss: float = 0.0
    sww: float = 0.0
    sws: float = 0.0
    steps: int = 0

    def observe(self, work: float, seconds: float) -> None:
        keep = 1.0 - STEP_DECAY
        self.n, self.sw, self.ss = self.n * keep + 1, self.sw * keep + work, self.ss * keep + seconds
        self.sww, self.sws = self.sww * keep + work * work, self.sws * keep + work * seconds
        self.steps += 1

    def line(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per unit of work), or None until a rising line fits."""
        if self.steps < MIN_STEPS:
            return None
        var = self.sww * self.n - self.sw * self.sw
        if var <= 1e-12 * max(self.sww * self.n, 1e-30):
            return None
        slope = (self.sws * self.n - self.sw * self.ss) / var
        fixed = (self.ss - slope * self.sw) / self.n
        return (max(fixed, 0.0), slope) if slope > 0 else None


def token_work(kv_len: int, n: int, attention_per_position: float) -> float:
    """The work of running n tokens after kv_len cached ones."""
    return n + attention_per_position * (n * kv_len + n * (n + 1) / 2)


class StepBudget:
    def __init__(self, chunk: int, max_prefill_tokens: int, slowdown: float, attention_per_position: float) -> None:
        self.chunk, self.max_prefill_tokens = chunk, max_prefill_tokens
        self.slowdown, self.attention = slowdown, attention_per_position
        self.cost = StepCost()
        self.cut_steps = 0  # steps whose prefill the decodes' cadence cut

    def observe(self, runs: list[tuple[int, int]], seconds: float) -> None:
        """A step ran `runs` (kv_len before it, tokens run) in seconds."""
        if seconds > 0 and runs:
            self.cost.observe(sum(token_work(k, n, self.attention) for k, n in runs), seconds)

    def prefill_work(self, decoding: list[int]) -> float | None:
        """The prefill work a step may add beside decodes at these kv_lens (None: no cut)."""
        line = self.cost.line() if self.slowdown and decoding else None
        if line is None:
            return None
        fixed, per_work = line
        decode_seconds = fixed + per_work * sum(token_work(k, 1, self.attention) for k in decoding)
        return (self.slowdown - 1.0) * decode_seconds / per_work

    def tokens_for(self, kv_len: int, want: int, work_left: float | None) -> int:
        """Of `want` tokens after kv_len cached ones, how many fit in work_left (None: all)."""
        if work_left is None or token_work(kv_len, want, self.attention) <= work_left:
            return want
        lo, hi = 0, want  # the largest n whose work fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if token_work(kv_len, mid, self.attention) <= work_left:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def stats(self) -> dict[str, int]:
        return {"prefill_cut_steps": self.cut_steps}


class StepTokens:
    """One step's prefill budget as it is spent: tokens (--max-prefill-tokens), the decodes'
    cadence in work (StepBudget.prefill_work), and, when several tenants have prompt tokens to
    run, each tenant's fraction of both. A request's chunk is at most --chunked-prefill-size; the
    first chunk a tenant runs in a step is at least MIN_CHUNK tokens (or what its prompt has
    left), so a cut step still moves every prompt forward."""

    def __init__(self, budget: StepBudget, decoding: list[int], shares: dict[str, float] | None) -> None:
        """decoding: the kv_lens of the requests decoding in this step."""
        self.budget, self.shares = budget, shares
        self.tokens_total, self.work_total = budget.max_prefill_tokens, budget.prefill_work(decoding)
        self.tokens_left, self.work_left = self.tokens_total, self.work_total
        self.spent: dict[str, tuple[int, float]] = defaultdict(lambda: (0, 0.0))  # tenant -> (tokens, work)
        self.cut = 0  # 1 once the cadence limited a chunk

    @property
    def exhausted(self) -> bool:
        """No prompt token may run any more this step (the cadence cuts only long prompts: allow)."""
        return self.tokens_left <= 0

    @property
    def cutting(self) -> bool:
        """The decodes' cadence limits this step (requests decode and the step cost is fitted)."""
        return self.work_total is not None

    def allow(self, r: Req, want: int, start: int | None = None) -> int:
        """How many of r's next `want` prompt tokens, after `start` cached ones (default: its
        kv_len), run this step (0: none; r waits). A prompt whose uncached part is longer than
        LONG_PROMPT is cut from then on (Req.long_prefill), to its last chunk."""
        share = self.shares.get(r.tenant, 1.0) if self.shares is not None else 1.0
        tokens, work = self.spent[r.tenant]
        n = max(0, min(want, self.budget.chunk, self.tokens_left, int(share * self.tokens_total) - tokens))
        if not self.cutting:
            return n
        r.long_prefill |= want > LONG_PROMPT
        if not r.long_prefill:
            return n
        left = max(0.0, min(self.work_left, share * self.work_total - work))
        fit = self.budget.tokens_for(r.kv_len if start is None else start, n, left)
        if tokens == 0:  # the tenant's first chunk this step: a cut step still moves it forward
            fit = max(fit, min(n, MIN_CHUNK))
        self.cut |= fit < n
        return fit

    def spend(self, r: Req, n: int) -> None:
        w = token_work(r.kv_len, n, self.budget.attention)
        tokens, work = self.spent[r.tenant]
        self.spent[r.tenant] = (tokens + n, work + w)
        self.tokens_left -= n
        if self.work_left is not None:
            self.work_left -= w
