"""Preemption: when the KV pool cannot hold what must run, which running request gives its pages
back, and how: swapped out to host memory (--preemption-mode) or queued to compute its sequence
again, or, when even one request alone cannot fit, refused; and the counts of each. The scheduler
asks it to make room; priorities and tenants extend `victim` later. Requests whose KV a failed
disk-tier read lost give their pages back here too, and run again."""

from __future__ import annotations

import logging
from collections.abc import Callable

from radixrt.messages import DiskFaults, FinishReason
from radixrt.scheduler.budget import AdmissionBudget
from radixrt.scheduler.kv_memory import KVMemory
from radixrt.scheduler.logprobs import forget_prompt_logprobs
from radixrt.scheduler.req import Req, longrope_namespace

logger = logging.getLogger(__name__)
# why a running request gave its pages back (SchedulerStats.retractions_by_cause, /metrics' cause label):
# decode_growth: decoding requests needed pages for their next tokens; admission: nothing could run
# at all; long_rope: a longrope model's sequence outgrew its original context and runs again;
# priority: a waiting request that outranks it needed its slot or pages (scheduler/priorities.py)
RETRACTION_CAUSES = ("decode_growth", "admission", "long_rope", "priority")


class Preemption:
    def __init__(self, mode: str, swap_min_tokens: int, mem: KVMemory, budget: AdmissionBudget, waiting: list[Req],
                 release: Callable[[Req], None], finish: Callable[[Req, FinishReason], None]) -> None:
        """waiting: the scheduler's queue (a retracted request goes first); release: takes a
        request out of the running batch and gives its pages back; finish: ends a request."""
        self.mode, self.swap_min_tokens = mode, swap_min_tokens
        self.mem, self.budget, self.waiting, self.release, self.finish = mem, budget, waiting, release, finish
        self.retractions = self.swaps_out = self.refused_no_memory = 0
        self.by_cause = dict.fromkeys(RETRACTION_CAUSES, 0)

    def make_room(self, running: list[Req], cause: str) -> Req:
        """Nothing fits: a running request gives its pages back (cause: RETRACTION_CAUSES), or ends
        when it runs alone; with none running, the first waiting one is refused (it cannot fit even
        an empty pool). Returns the request that made room."""
        if running:
            victim = self.victim(running)
            if len(running) == 1:
                self.refused_no_memory += 1
                self.finish(victim, FinishReason("abort", message="the KV pool is too small for this sequence"))
            else:
                self.retract(victim, cause)
            return victim
        r = self.waiting.pop(0)
        pool = self.mem.allocator.num_pages
        self.refused_no_memory += 1
        self.finish(r, FinishReason("abort", message=f"the prompt needs more KV pages than the pool's {pool}"))
        return r

    @staticmethod
    def victim(running: list[Req]) -> Req:
        """The request that gives its pages back: the newest admitted."""
        return max(running, key=lambda r: r.admitted_at)

    def retract(self, r: Req, cause: str) -> None:
        """Give r's pages back and queue it first: swapped to host memory (by --preemption-mode),
        or to recompute prompt + output so far (what the prefix cache still holds is reused)."""
        swapped = self._swaps(r) and r.sampling.max_new_tokens > 0 and self.mem.swap.out(r)
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

    def recompute_lost(self, faults: DiskFaults | None, running: list[Req],
                       inflight: list[tuple[Req, int]]) -> dict[int, bool]:
        """The disk tier's failures in this step's moves: their pages leave its index, and a running
        request whose page table holds a page a failed read left without KV gives its pages back
        and runs its sequence again (a cache miss: same tokens, more compute); the pages leave the
        prefix cache. Returns its in-flight entries, each with whether the worker sampled for it."""
        if faults is None or self.mem.tiers is None:
            return {}
        self.mem.tiers.disk_tier.failed(faults)
        pages = set(faults.lost_pages)
        lost = [r for r in running if pages.intersection(r.kv.pages)]
        entries = {i: r.kv_len + n == r.seq_len and r.sampling.max_new_tokens > 0
                   for i, (r, n) in enumerate(inflight) if r in lost}
        if lost:
            logger.warning("recomputing %d requests: the disk KV tier could not load %d of their pages",
                           len(lost), len(pages))
        for r in lost:
            self.requeue_to_recompute(r)
        self.mem.bridge.forget(pages)
        return entries

    def _swaps(self, r: Req) -> bool:
        if r.kv.dropped:  # the worker's copy of its sinks' keys leaves with the slot: recompute it
            return False
        return self.mode == "swap" or (self.mode == "auto" and r.kv_len >= self.swap_min_tokens)

    def stats(self) -> dict[str, int | dict[str, int]]:
        return {"retractions": self.retractions, "swaps_out": self.swaps_out,
                "retractions_by_cause": dict(self.by_cause), "requests_refused_no_memory": self.refused_no_memory}
