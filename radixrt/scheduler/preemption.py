"""Preemption: when the KV pool cannot hold what must run, which running request gives its pages
back, and how: swapped out to host memory (--preemption-mode) or queued to compute its sequence
again; and the counts of both. The scheduler asks it for a victim and hands the victim over;
priorities and tenants extend `victim` later."""

from __future__ import annotations

import logging
from collections.abc import Callable

from radixrt.scheduler.budget import AdmissionBudget
from radixrt.scheduler.kv_memory import KVMemory
from radixrt.scheduler.logprobs import forget_prompt_logprobs
from radixrt.scheduler.req import Req, longrope_namespace

logger = logging.getLogger(__name__)
# why a running request gave its pages back (SchedulerStats.retractions_by_cause, /metrics' cause label):
# decode_growth: decoding requests needed pages for their next tokens; admission: nothing could run
# at all; long_rope: a longrope model's sequence outgrew its original context and runs again
RETRACTION_CAUSES = ("decode_growth", "admission", "long_rope")


class Preemption:
    def __init__(self, mode: str, swap_min_tokens: int, mem: KVMemory, budget: AdmissionBudget,
                 waiting: list[Req], release: Callable[[Req], None]) -> None:
        """waiting: the scheduler's queue (a retracted request goes first); release: takes a
        request out of the running batch and gives its pages back."""
        self.mode, self.swap_min_tokens = mode, swap_min_tokens
        self.mem, self.budget, self.waiting, self.release = mem, budget, waiting, release
        self.retractions = self.swaps_out = 0
        self.by_cause = dict.fromkeys(RETRACTION_CAUSES, 0)

    @staticmethod
    def victim(running: list[Req]) -> Req:
        """The request that gives its pages back: the newest admitted."""
        return max(running, key=lambda r: r.admitted_at)

    def retract(self, r: Req, cause: str) -> None:
        """Give r's pages back and queue it first: swapped to host memory (by --preemption-mode),
        or to recompute prompt + output so far (what the prefix cache still holds is reused)."""
        swapped = self._swaps(r) and r.sampling.max_new_tokens > 0 and self.mem.swap_out(r)
        logger.info("retracting %s (%d tokens, %s) to free KV pages", r.rid, r.seq_len, "swapped" if swapped else "to recompute")
        if swapped:
            self.swaps_out += 1
            self.release(r)
            self.waiting.insert(0, r)
        else:
            self.requeue_to_recompute(r)
        self.retractions += 1
        self.by_cause[cause] += 1
        self.budget.on_retract()

    def requeue_to_recompute(self, r: Req) -> None:
        """r gives its pages back (the cache keeps its full ones) and waits first, to run its sequence again."""
        r.recompute_len = r.kv_len
        self.release(r)
        forget_prompt_logprobs(r)
        self.waiting.insert(0, r)

    def recompute_under_long_rope(self, r: Req) -> None:
        """r's sequence just outgrew a longrope model's original context. transformers' Phi-3 then
        recomputes the whole sequence under the long rope factors (its generate drops the KV
        cache), so r's short-factor KV goes to the cache (for short prompts) and r runs again
        in the long namespace."""
        self.requeue_to_recompute(r)
        self.by_cause["long_rope"] += 1
        r.long_rope = True
        r.namespace = longrope_namespace(r.namespace, True)

    def _swaps(self, r: Req) -> bool:
        if r.kv.dropped:  # the worker's copy of its sinks' keys leaves with the slot: recompute it
            return False
        return self.mode == "swap" or (self.mode == "auto" and r.kv_len >= self.swap_min_tokens)

    def stats(self) -> dict[str, int | dict[str, int]]:
        return {"retractions": self.retractions, "swaps_out": self.swaps_out, "retractions_by_cause": dict(self.by_cause)}
