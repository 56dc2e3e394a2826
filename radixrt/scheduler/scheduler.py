"""Scheduler: admits requests, assigns pages and slots, builds each step's batch,
and turns the worker's sampled ids into per-request outputs.

One step = grow every decoding request by one token, then fill the remaining
prefill budget (chunked) from partially prefilled and waiting requests. When
pages run out for the decodes, the most recently admitted request is retracted
to the front of the queue and later recomputed, so nothing fails.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from radixrt.cache import PageAllocator
from radixrt.config import ServerArgs
from radixrt.messages import (
    BatchEntry,
    BatchResult,
    EntryLogprobs,
    FinishReason,
    ForwardBatch,
    LogprobSpec,
    ReqOutput,
    SlotInit,
    TokenizedRequest,
    WorkerReady,
)
from radixrt.scheduler.budget import AdmissionBudget
from radixrt.scheduler.policy import SCHEDULE_POLICIES
from radixrt.scheduler.req import Req
from radixrt.scheduler.stop import StopChecker

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, args: ServerArgs, worker: WorkerReady, tokenizer: Any) -> None:
        self.args = args
        self.page_size = worker.page_size
        self.allocator = PageAllocator(worker.num_pages)
        self.stop = StopChecker(tokenizer, worker.eos_ids, worker.context_length)
        self.policy = SCHEDULE_POLICIES["fcfs"]
        self.budget = AdmissionBudget(worker.page_size)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.free_slots = list(range(args.max_running_requests - 1, -1, -1))
        self.freed_slots: list[int] = []  # to tell the worker with the next batch
        self.inflight: list[tuple[Req, int]] = []  # (request, tokens run) per entry of the batch in flight
        self.outbox: list[ReqOutput] = []
        self.step_no = 0
        self.admissions = 0
        self.retractions = 0

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    # -- requests in and out --------------------------------------------------

    def add_request(self, msg: TokenizedRequest) -> None:
        self.waiting.append(Req.from_msg(msg))

    def abort(self, rid: str) -> None:
        for r in self.waiting:
            if r.rid == rid:
                self.waiting.remove(r)
                return self._finish(r, FinishReason("abort", message="aborted by client"))
        for r in self.running:
            if r.rid == rid:
                return self._finish(r, FinishReason("abort", message="aborted by client"))

    def take_outputs(self) -> list[ReqOutput]:
        out, self.outbox = self.outbox, []
        return out

    # -- the scheduling decision ----------------------------------------------

    def schedule(self) -> ForwardBatch | None:
        """The next step's batch, or None when there is nothing to run."""
        entries: list[BatchEntry] = []
        self.inflight = []
        while not entries and not self.idle:
            self._schedule_decodes(entries)
            self._schedule_prefills(entries)
            if not entries and not self.idle:
                self._make_room()
        if not entries:
            return None
        self.step_no += 1
        self.budget.on_step()
        batch = ForwardBatch(step=self.step_no, entries=entries, freed_slots=self.freed_slots)
        self.freed_slots = []
        return batch

    def _schedule_decodes(self, entries: list[BatchEntry]) -> None:
        decoding = [r for r in self.running if r.is_decoding]
        while sum(self._pages_needed(r, 1) for r in decoding) > self.allocator.num_free:
            victim = self._make_room()
            if victim in decoding:
                decoding.remove(victim)
        for r in decoding:
            entries.append(self._entry(r, 1))

    def _schedule_prefills(self, entries: list[BatchEntry]) -> None:
        token_budget = self.args.prefill_chunk
        # Admitted requests always progress, by as much as the free pages allow.
        for r in [r for r in self.running if not r.is_decoding]:
            n = self._fit_tokens(r, min(r.extend_len, token_budget))
            if n > 0:
                entries.append(self._entry(r, n))
                token_budget -= n
        # New requests come in whole chunks, keeping pages back for the running ones' growth.
        reserve = self.budget.reserve_pages(self.running)
        for r in self.policy(self.waiting):
            n = min(r.extend_len, token_budget)
            if n <= 0 or not self.free_slots or self._pages_needed(r, n) + reserve > self.allocator.num_free:
                break
            self._admit(r)
            entries.append(self._entry(r, n))
            token_budget -= n
            reserve += self.budget.reserve_pages([r])

    def _make_room(self) -> Req | None:
        """Nothing fits: retract the newest running request, or, with none running,
        reject the first waiting one (it cannot fit even an empty pool)."""
        if self.running:
            victim = max(self.running, key=lambda r: r.admitted_at)
            if len(self.running) == 1:
                self._finish(victim, FinishReason("abort", message="the KV pool is too small for this sequence"))
            else:
                self._retract(victim)
            return victim
        r = self.waiting.pop(0)
        self._finish(r, FinishReason("abort", message=f"the prompt needs more KV pages than the pool's {self.allocator.num_pages}"))
        return r

    def _fit_tokens(self, r: Req, n: int) -> int:
        """The most of n next tokens of r whose pages are free now."""
        capacity = (len(r.pages) + self.allocator.num_free) * self.page_size - r.kv_len
        return max(0, min(n, capacity))

    def _pages_needed(self, r: Req, n: int) -> int:
        return math.ceil((r.kv_len + n) / self.page_size) - len(r.pages)

    def _admit(self, r: Req) -> None:
        self.waiting.remove(r)
        r.slot = self.free_slots.pop()
        r.slot_initialized = False
        self.admissions += 1
        r.admitted_at = self.admissions
        self.running.append(r)

    def _entry(self, r: Req, n: int) -> BatchEntry:
        start = r.kv_len
        new_pages = self.allocator.alloc(self._pages_needed(r, n))
        r.pages += new_pages
        sample = start + n == r.seq_len and r.sampling.max_new_tokens > 0
        init = None
        if not r.slot_initialized:
            penalty_ids = r.prompt_ids if r.sampling.repetition_penalty != 1 else []
            init = SlotInit(r.sampling, self.stop.stop_ids(r), penalty_ids, list(r.output_ids))
        self.inflight.append((r, n))
        return BatchEntry(r.slot, r.tokens(start, start + n), start, new_pages, sample, init, self._logprob_spec(r, start, n))

    @staticmethod
    def _logprob_spec(r: Req, start: int, n: int) -> LogprobSpec | None:
        if not r.return_logprob:
            return None
        prompt_from, targets = -1, []
        if r.wants_prompt_logprobs:
            # Row j predicts prompt token j + 1; wanted targets are [max(start_len, 1), prompt_len).
            lo = max(start, max(r.logprob_start_len, 1) - 1)
            hi = min(start + n, r.prompt_len - 1)
            if hi > lo:
                prompt_from, targets = lo - start, r.prompt_ids[lo + 1 : hi + 1]
        return LogprobSpec(prompt_from, targets, r.top_logprobs_num, output=True)

    # -- results ---------------------------------------------------------------

    def process(self, batch: BatchResult) -> None:
        """Apply the worker's result for the batch in flight."""
        ids = iter(batch.next_ids)
        for i, (r, n) in enumerate(self.inflight):
            lp = batch.logprobs[i] if batch.logprobs else None
            r.kv_len += n
            r.slot_initialized = True
            if lp is not None and lp.prompt:
                r.input_logprobs += lp.prompt
                r.input_top += lp.prompt_top
            sampled = r.kv_len == r.seq_len and r.sampling.max_new_tokens > 0
            out = ReqOutput(r.rid, [], prompt_tokens=r.prompt_len, cached_tokens=r.cached_tokens)
            self._attach_prompt_logprobs(r, out)
            if sampled:
                r.output_ids.append(next(ids))
                out.new_ids = [r.output_ids[-1]]
                self._attach_output_logprobs(lp, out)
                r.finish = self.stop.check(r)
            elif r.kv_len == r.seq_len:  # a prefill-only request (max_new_tokens 0) is done
                r.finish = FinishReason("length", length=0)
            if out.new_ids or out.input_logprobs is not None or r.finish is not None:
                out.finish = r.finish
                self.outbox.append(out)
            if r.finish is not None:
                self._release(r)
        self.inflight = []

    def _attach_prompt_logprobs(self, r: Req, out: ReqOutput) -> None:
        if r.kv_len < r.prompt_len or not r.wants_prompt_logprobs:
            return
        first: list = [None] if r.logprob_start_len == 0 else []
        out.input_logprobs = first + r.input_logprobs
        out.input_top = first + r.input_top if r.top_logprobs_num > 0 else None
        r.prompt_logprobs_sent = True

    @staticmethod
    def _attach_output_logprobs(lp: EntryLogprobs | None, out: ReqOutput) -> None:
        if lp is None or lp.output is None:
            return
        out.output_logprobs = [lp.output]
        out.output_top = [lp.output_top] if lp.output_top is not None else []

    # -- freeing ---------------------------------------------------------------

    def _finish(self, r: Req, reason: FinishReason) -> None:
        r.finish = reason
        self.outbox.append(ReqOutput(r.rid, [], reason, r.prompt_len, r.cached_tokens))
        if r in self.running:
            self._release(r)

    def _release(self, r: Req) -> None:
        self.allocator.free(r.pages)
        r.pages = []
        self.running.remove(r)
        self.free_slots.append(r.slot)
        self.freed_slots.append(r.slot)
        r.slot = None

    def _retract(self, r: Req) -> None:
        """Give r's pages back and queue it first; it will recompute prompt + output so far."""
        logger.info("retracting %s (%d tokens) to free KV pages", r.rid, r.seq_len)
        self._release(r)
        r.kv_len = 0
        if not r.prompt_logprobs_sent:
            r.input_logprobs, r.input_top = [], []
        self.waiting.insert(0, r)
        self.retractions += 1
        self.budget.on_retract()

    def stats(self) -> dict[str, int]:
        return {
            "num_pages": self.allocator.num_pages,
            "free_pages": self.allocator.num_free,
            "used_pages": sum(len(r.pages) for r in self.running),
            "running": len(self.running),
            "waiting": len(self.waiting),
            "retractions": self.retractions,
        }
