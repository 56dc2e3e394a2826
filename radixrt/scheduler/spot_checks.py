"""Quality spot checks, scheduler side (--quality-spot-check-rate): which requests are checked,
the checks waiting for idle time, and their figures.

A sampled plain-greedy request (SamplingParams.plain_greedy: its emitted token is the model's
top token) asks the worker for the logprob of each token it emits, whether or not its client
asked for logprobs. When it finishes (stop or length), its prompt, output and those logprobs
queue as a check. The scheduler's loop sends a check's chunks (SpotCheck) only while it has no
request running or waiting; the worker (worker/spot_check.py) compares them with the reference
configuration. Figures: checks and tokens done, token-weighted top-1 agreement and mean
|delta logprob| since start, the last check's, and checks pending or skipped (a full queue
drops its oldest; a request too long for the reference pool is never queued).
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from dataclasses import dataclass

from radixrt.messages import EntryLogprobs, SpotCheck, SpotCheckResult
from radixrt.scheduler.req import Req

logger = logging.getLogger(__name__)
WARN_EVERY_S = 60.0


@dataclass(frozen=True)
class SpotJob:
    check_id: int
    prompt_ids: list[int]
    output_ids: list[int]
    live_logprobs: list[float]


class SpotChecks:
    def __init__(self, rate: float, min_agreement: float, queue: int, seed: int, max_tokens: int) -> None:
        """max_tokens: the longest prompt + output the reference pool holds (0: no longrope limit)."""
        self.rate, self.min_agreement, self.max_tokens = rate, min_agreement, max_tokens
        self.rng = random.Random(seed)
        self.pending: deque[SpotJob] = deque(maxlen=queue)
        self.current: SpotJob | None = None  # its chunks are under way
        self.next_id = 0
        self.checks = self.tokens = self.skipped = 0
        self.agreeing = 0.0  # emitted tokens that were the reference's top token
        self.abs_dlogprob = 0.0  # sum over checked tokens of |live - reference logprob|
        self.last: SpotCheckResult | None = None
        self._warned_at = -WARN_EVERY_S

    def sample(self, r: Req) -> None:
        """At arrival: is r one of the checked requests? (Not one of a LoRA adapter: the reference
        runs the base model.)"""
        r.spot_check = (self.rate > 0 and r.sampling.plain_greedy and r.namespace.adapter is None
                        and self.rng.random() < self.rate)

    @staticmethod
    def note_output(r: Req, lp: EntryLogprobs | None) -> None:
        """Keep the live logprob of the token r just emitted."""
        if r.spot_check and lp is not None and lp.output is not None:
            r.live_logprobs.append(lp.output)

    def on_finish(self, r: Req) -> None:
        """r is done: queue its check, when it is a checked request that ran to its end."""
        if not r.spot_check or r.finish is None or r.finish.type not in ("stop", "length") or not r.output_ids:
            return
        if len(r.live_logprobs) != r.output_len or (self.max_tokens and r.seq_len > self.max_tokens):
            self.skipped += 1
            return
        if len(self.pending) == self.pending.maxlen:
            self.skipped += 1  # the deque drops its oldest
        self.pending.append(SpotJob(self.next_id, r.prompt_ids, list(r.output_ids), list(r.live_logprobs)))
        self.next_id += 1

    @property
    def has_work(self) -> bool:
        return self.current is not None or bool(self.pending)

    def next_message(self) -> SpotCheck:
        """The next chunk to run: the current check's, or a new check's first (with its tokens)."""
        if self.current is not None:
            return SpotCheck(self.current.check_id)
        job = self.current = self.pending.popleft()
        return SpotCheck(job.check_id, job.prompt_ids, job.output_ids, job.live_logprobs)

    def record(self, res: SpotCheckResult) -> None:
        """The worker's answer to the chunk just sent."""
        if not res.done:
            return
        self.current = None
        if res.error:
            logger.error("quality spot check failed: %s", res.error)
            self.skipped += 1
            return
        self.checks += 1
        self.tokens += res.positions
        self.agreeing += res.top1_agreement * res.positions
        self.abs_dlogprob += res.mean_abs_dlogprob * res.positions
        self.last = res
        now = time.monotonic()
        if res.top1_agreement < self.min_agreement and now - self._warned_at >= WARN_EVERY_S:
            self._warned_at = now
            logger.warning("quality spot check: top-1 agreement %.3f with the reference (model-dtype KV, no retention, "
                           "no cache) is below %.3f over %d tokens (mean |dlogprob| %.4f, max %.4f); further warnings "
                           "wait %.0f s", res.top1_agreement, self.min_agreement, res.positions, res.mean_abs_dlogprob,
                           res.max_abs_dlogprob, WARN_EVERY_S)

    def stats(self) -> dict[str, int | float]:
        last = self.last
        return {
            "quality_spot_checks": self.checks,
            "quality_spot_check_tokens": self.tokens,
            "quality_top1_agreement": self.agreeing / self.tokens if self.tokens else 0.0,
            "quality_mean_abs_dlogprob": self.abs_dlogprob / self.tokens if self.tokens else 0.0,
            "quality_last_top1_agreement": last.top1_agreement if last else 0.0,
            "quality_last_mean_abs_dlogprob": last.mean_abs_dlogprob if last else 0.0,
            "quality_spot_checks_pending": len(self.pending) + (self.current is not None),
            "quality_spot_checks_skipped": self.skipped,
        }
