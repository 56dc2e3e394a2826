"""TierCosts: whether a page held in a lower tier is cheaper to load or to recompute, by measurement.

Loading a page is one KVMove (host->device or disk->device); the worker makes the moves before
the step that reads them, so a load delays that step by its transfer time. Recomputing a page
puts its tokens into a prefill step instead, which costs that step's compute. Both are wall
seconds of the same step loop, so they compare directly.

What is measured (plain Python; the worker reports the times, the scheduler feeds them here):
- per move kind, seconds per page: seeded by the worker's start-up probe (WorkerReady), then
  the worker's time on every move it runs (BatchResult.move_times);
- prefill seconds per unit of work, over the recent steps that ran a prefill chunk. A token's
  work is 1 + attention_per_position * p, p the positions it attends: per-token FLOPs are about
  2 * (linear parameters) + 4 * p * layers * heads * head_dim, so attention_per_position is the
  ratio of the second term's factor to the first's (worker/tier_probe.py computes it from the
  model's config; every layer counted as full attention). A page at a deep position so costs
  more to recompute than one near the start.

Both estimates are decayed ratios of sums (seconds over pages, seconds over work) across recent
observations, each older one weighing (1 - decay) less, so they follow the machine's load.
The prefill estimate is the cost per token at the batch sizes now running: a step's fixed cost
spread over its tokens. Under load, where the step budget is full, that is what a recomputed
token displaces; on an idle server it overstates the marginal cost, which leans toward loading,
the behaviour without this choice.

Until a figure is measured (a probe that failed, no prefill step yet), the choice is to load:
nothing is guessed. The first prefill step is not counted: it pays one-time costs (kernel
compilation, the allocator's growth).
"""

from __future__ import annotations

from dataclasses import dataclass

from radixrt.cache.eviction import relative_recompute_cost
from radixrt.messages import MoveKind

MOVE_DECAY = 0.1  # about the last 10 moves of a kind
# A load estimate is refreshed only by loads: after this many runs recomputed in a row because
# a kind looked dear, the next run of it is loaded anyway, so a transient (a pause, a busy disk)
# that inflated the estimate cannot keep the choice on recompute for good.
EXPLORE_AFTER = 4
PREFILL_DECAY = 0.1  # about the last 10 prefill steps
LOAD_KINDS = (MoveKind.H2D, MoveKind.DISK2D)  # how a lower-tier page comes back to the device


@dataclass
class DecayedRate:
    """seconds / amount over recent observations; the older ones decayed. 0.0: nothing observed."""

    decay: float
    seconds: float = 0.0
    amount: float = 0.0

    def observe(self, amount: float, seconds: float) -> None:
        keep = 1.0 - self.decay
        self.seconds = self.seconds * keep + seconds
        self.amount = self.amount * keep + amount

    @property
    def rate(self) -> float:
        return self.seconds / self.amount if self.amount > 0 else 0.0


class TierCosts:
    """Running estimates of load and recompute costs, and the choice between them.

    The seeds are the worker's start-up probe (seconds per page; 0.0: not measured)."""

    def __init__(self, h2d_s_per_page: float = 0.0, disk2d_s_per_page: float = 0.0,
                 attention_per_position: float = 0.0, always_load: bool = False) -> None:
        self.attention_per_position = attention_per_position
        self.always_load = always_load  # --hicache-load-policy always: every held page is read back
        self.moves = {kind: DecayedRate(MOVE_DECAY) for kind in MoveKind}
        for kind, seed in ((MoveKind.H2D, h2d_s_per_page), (MoveKind.DISK2D, disk2d_s_per_page)):
            if seed > 0:
                self.moves[kind].observe(1, seed)
        self.prefill = DecayedRate(PREFILL_DECAY)  # seconds per unit of work (work_of)
        self.prefill_steps = 0  # prefill steps observed, the first (not counted) included
        self.load_pages = 0  # lower-tier pages the choice loaded
        self.recompute_pages = 0  # and those it recomputed instead
        self.unrefreshed = dict.fromkeys(LOAD_KINDS, 0)  # runs recomputed since the kind's last load

    # -- measurements ---------------------------------------------------------------

    def observe_moves(self, kind: MoveKind, pages: int, seconds: float) -> None:
        """The worker spent seconds on moves of kind covering pages pages."""
        if pages > 0 and seconds > 0:
            self.moves[kind].observe(pages, seconds)
            if kind in self.unrefreshed:
                self.unrefreshed[kind] = 0

    def observe_prefill(self, tokens: int, seconds: float, attended: int = 0) -> None:
        """A step that ran a prefill chunk took seconds for tokens tokens, which attended to
        `attended` positions in all (the sum over its tokens; 0: attention not counted)."""
        if tokens <= 0 or seconds <= 0:
            return
        self.prefill_steps += 1
        if self.prefill_steps > 1:
            self.prefill.observe(tokens + self.attention_per_position * attended, seconds)

    # -- estimates ------------------------------------------------------------------

    def load_seconds(self, kind: MoveKind) -> float:
        """Seconds to bring back one page by kind (H2D or DISK2D); 0.0: not measured."""
        return self.moves[kind].rate

    def recompute_seconds(self, page: int, page_size: int) -> float:
        """Seconds to recompute the page at index `page` of a sequence; 0.0: not measured."""
        first = page * page_size + 1  # positions its first token attends to (itself included)
        attended = page_size * first + page_size * (page_size - 1) // 2
        return self.prefill.rate * (page_size + self.attention_per_position * attended)

    def relative_recompute_cost(self, start: int, n: int) -> float:
        """Recomputing tokens [start, start + n), in tokens of work without attention: the cost eviction
        policy's price (cache/eviction.py), by the model's attention share once the worker reported it."""
        if self.attention_per_position <= 0:
            return relative_recompute_cost(start, n)
        return relative_recompute_cost(start, n, self.attention_per_position)

    def pages_to_load(self, sources: list[MoveKind], start_page: int, page_size: int, count: bool = True) -> int:
        """How many leading pages of a run a request would read from the lower tiers to load;
        the rest are recomputed. sources[i] is how page start_page + i would come back (H2D or
        DISK2D). A page is only usable after the pages before it, so the choice is a prefix:
        the n that saves the most time, sum over i < n of recompute(i) - load(i), loading only
        where it saves time (0: loading never pays). Unmeasured figures choose loading, and so
        does a kind whose estimate EXPLORE_AFTER recomputed runs have not refreshed, and so does
        every run under --hicache-load-policy always.
        count: add the choice to the counters (False for an estimate that loads nothing)."""
        stale = any(self.unrefreshed[kind] >= EXPLORE_AFTER for kind in set(sources))
        if self.always_load or self.prefill.rate == 0.0 or (count and stale):
            n = len(sources)
        else:
            n, best, saved = 0, 0.0, 0.0
            for i, kind in enumerate(sources):
                assert kind in LOAD_KINDS, f"{kind} does not bring a page back to the device"
                saved += self.recompute_seconds(start_page + i, page_size) - self.load_seconds(kind)
                if saved > best:
                    n, best = i + 1, saved
        if count:
            self.load_pages += n
            self.recompute_pages += len(sources) - n
            for kind in set(sources[n:]):  # loads will refresh the kinds loaded
                self.unrefreshed[kind] += 1
        return n

    def stats(self) -> dict[str, int | float]:
        """The choice's counters and the estimates behind it (0: not measured), for SchedulerStats."""
        return {
            "tier_load_pages": self.load_pages,
            "tier_recompute_pages": self.recompute_pages,
            "cost_h2d_s_per_page": self.load_seconds(MoveKind.H2D),
            "cost_disk_s_per_page": self.load_seconds(MoveKind.DISK2D),
            "cost_prefill_s_per_token": self.prefill.rate,
            "cost_attention_per_position": self.attention_per_position,
            "cost_prefill_steps": self.prefill_steps,
        }
