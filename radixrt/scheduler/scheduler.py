"""Scheduler: builds each step's batch and turns the worker's result into per-request outputs.
Page ownership lives in KVMemory; the other jobs are its collaborators': queues.py says where each
request is, arrivals.py takes requests in (intake.py checks them, weight_update.py holds them
while the weights change), admission.py decides whether a waiting one gets its pages,
preemption.py makes room, step_results.py applies a step's result (outputs.py reads it for one
request), spot_checks.py samples quality checks. LoRA (lora_requests.py), speculation
(speculation.py) and readouts (readouts.py) are hooks the step calls whether they are on or not.

One step = grow every decoding request by one token, then fill the prefill
budget (chunked) from partially prefilled requests and then waiting ones in
policy order, each starting from its longest cached prefix. A waiting request
that shares a not-yet-cached prefix with one admitted this step waits a step,
so the shared part is computed once and then hit. When pages run out, the cache
evicts first; then the most recently admitted request is retracted (what it
computed goes into the cache) and recomputed later, or, by --preemption-mode,
swapped to host memory and back, so nothing fails.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from radixrt.cache.eviction import EvictionOrder
from radixrt.config_views import SchedulerConfig
from radixrt.messages import (
    BatchEntry,
    BatchResult,
    FinishReason,
    ForwardBatch,
    KVMove,
    ReqOutput,
    SchedulerStats,
    TokenizedRequest,
    WorkerReady,
)
from radixrt.retention.counters import RetentionCounters
from radixrt.retention.rules import RetentionRules
from radixrt.scheduler.admission import Admitter, Outcome
from radixrt.scheduler.arrivals import Arrivals
from radixrt.scheduler.budget import AdmissionBudget
from radixrt.scheduler.cache_hits import cached_details
from radixrt.scheduler.entries import EntryBuilder
from radixrt.scheduler.figures import SchedulerFigures
from radixrt.scheduler.grammars import GrammarWaitlist, reasoning_end_ids
from radixrt.scheduler.intake import Intake
from radixrt.scheduler.kv_memory import KVMemory
from radixrt.scheduler.kv_tiers import KVTiers
from radixrt.scheduler.lora_requests import LoraRequests
from radixrt.scheduler.lora_slots import LoraSlots, NoLoraSlots, StepAdapters
from radixrt.scheduler.outputs import StepOutputs
from radixrt.scheduler.policy import SCHEDULE_POLICIES
from radixrt.scheduler.preemption import Preemption
from radixrt.scheduler.priorities import Priorities
from radixrt.scheduler.queue_limits import QueueLimits
from radixrt.scheduler.queues import Queues
from radixrt.scheduler.req import Req
from radixrt.scheduler.speculation import Speculator
from radixrt.scheduler.spot_checks import SpotChecks
from radixrt.scheduler.step_budget import LONG_PROMPT, StepBudget, StepTokens
from radixrt.scheduler.step_costs import StepCosts
from radixrt.scheduler.step_results import StepResults
from radixrt.scheduler.stop import StopChecker
from radixrt.scheduler.tenants import Tenants
from radixrt.scheduler.tier_costs import TierCosts
from radixrt.scheduler.weight_update import WeightUpdates
from radixrt.settings.scheduling import tenant_table

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Scheduled:
    """One schedule() decision. The worker makes the tier moves first: the batch reads pages they
    bring back, and writes pages they free."""

    moves: list[KVMove]
    batch: ForwardBatch | None


def kv_memory(args: SchedulerConfig, worker: WorkerReady) -> tuple[TierCosts, KVMemory]:
    """The page pool, its prefix cache and lower tiers, and the costs that weigh loading a lower
    tier's pages against recomputing them: the worker's start-up probe, then what it reports."""
    tier_costs = TierCosts(worker.h2d_s_per_page, worker.disk2d_s_per_page, worker.attention_per_position,
                           always_load=args.hicache_load_policy == "always")
    order = EvictionOrder(args.radix_eviction_policy, tier_costs.relative_recompute_cost)
    tiers = None
    if worker.host_pages:
        tiers = KVTiers(worker.host_pages, args.enable_hierarchical_cache, worker.disk_dir, worker.disk_pages,
                        worker.page_size, order, args.hicache_write_policy, tier_costs, args.mooncake)
    mem = KVMemory(worker.num_pages, worker.page_size, use_cache=not args.disable_radix_cache, tiers=tiers,
                   order=order, pinned_fraction=args.max_pinned_fraction,
                   pinned_namespace_fraction=args.max_pinned_namespace_fraction)
    return tier_costs, mem


class Scheduler:
    def __init__(self, args: SchedulerConfig, worker: WorkerReady, tokenizer: Any) -> None:
        self.args, self.worker = args, worker
        self.tier_costs, self.mem = kv_memory(args, worker)
        self.weights = WeightUpdates(self.mem)
        self.stop = StopChecker(tokenizer, worker.eos_ids, worker.context_length)
        RetentionRules.for_worker(args.retention, worker)  # ValueError: this worker cannot run the server's settings
        self.retention = RetentionCounters()
        self.policy = SCHEDULE_POLICIES[args.schedule_policy]
        self.budget = AdmissionBudget(worker.page_size)
        self.queues = Queues(GrammarWaitlist(tokenizer, worker.vocab_size, worker.eos_ids, args.json_max_whitespace,
                                             reasoning_end_ids(tokenizer, args.reasoning_parser)),
                             args.max_running_requests)
        self.step_no = self.admissions = 0
        self.counters = dict.fromkeys(("prompt_tokens", "cached_prompt_tokens", "recomputed_tokens"), 0)
        self.admitter = Admitter(self.mem)
        self.preemption = Preemption(args.preemption_mode, args.swap_min_tokens, self.mem, self.budget,
                                     self.queues.waiting, self._release, self._finish)
        self.figures = SchedulerFigures(worker, args.tp_size)
        self.spot = SpotChecks(args.quality_spot_check_rate, args.quality_spot_check_min_agreement,
                               args.quality_spot_check_queue, args.random_seed,
                               worker.long_prompt_threshold or worker.context_length)
        self.outputs = StepOutputs(self.stop, self.spot, not args.disable_jump_forward)
        self.spec = Speculator(args.speculative, worker.page_size, worker.context_length, worker.attention_per_position)
        self.priorities = Priorities(args.enable_priority_scheduling, args.schedule_low_priority_values_first,
                                     args.priority_scheduling_preemption_threshold, args.abort_on_priority_when_disabled)
        self.limits = QueueLimits(args.max_queued_requests, args.req_waiting_timeout, args.req_running_timeout,
                                  args.enable_priority_scheduling)
        self.tenants = Tenants(tenant_table(args.api_keys_file), args.tenant_kv_quota, worker.num_pages)
        self.mem.set_quotas(self.tenants.quota_pages if self.tenants.has_quotas else None)
        slots = LoraSlots(args.lora) if args.lora is not None else NoLoraSlots()  # which adapter runs from which slot
        self.lora = LoraRequests(slots, self.mem, self.queues, self._finish)
        self.step_budget = StepBudget(args.prefill_chunk, args.max_prefill_tokens, args.max_decode_slowdown,
                                      worker.attention_per_position)
        self.costs = StepCosts(self.tier_costs, self.step_budget, self.spec)
        intake = Intake(worker.page_size, worker.vocab_size, worker.context_length, worker.long_prompt_threshold,
                        self.spot, self.figures)
        self.arrivals = Arrivals(self.queues, intake, self.lora, self.mem, self.weights, self.priorities, self.limits,
                                 self.tenants, self._finish)
        self.builder = EntryBuilder(self.queues, self.mem, self.spec, self.retention, self.stop)
        self.results = StepResults(self.queues, self.mem, self.outputs, self.spec, self.spot, self.preemption,
                                   worker.long_prompt_threshold, self._finish, self._release)

    @property
    def idle(self) -> bool:
        return self.queues.idle

    @property
    def waiting(self) -> list[Req]:
        return self.queues.waiting

    @property
    def running(self) -> list[Req]:
        return self.queues.running

    # -- requests in and out (arrivals.py) -------------------------------------------------------

    def add_request(self, msg: TokenizedRequest) -> None:
        self.arrivals.add(msg)

    def abort(self, rid: str) -> None:
        self.arrivals.abort(rid)

    def reject_undecodable(self, raw: bytes, error: Exception) -> None:
        self.arrivals.reject_undecodable(raw, error)

    def take_outputs(self) -> list[ReqOutput]:
        out = self.queues.take_outputs()
        self.figures.attach(out)
        return out

    def flush_cache(self) -> str | None:
        """Empty the prefix cache; returns why not when requests are in the system."""
        if not self.idle:
            return f"cannot flush the cache while {len(self.running)} running and {len(self.waiting)} waiting requests use it"
        self.mem.flush()
        self.spec.flush()
        return None

    # -- the scheduling decision ----------------------------------------------

    def schedule(self) -> Scheduled:
        """The next step: the tier moves the worker makes first, and the batch (None: nothing to run).
        Run it with scheduler/step.py, which makes the moves before the batch."""
        entries: list[BatchEntry] = []
        self.queues.inflight = []
        self.spec.step_started(time.perf_counter())
        now = time.monotonic()
        self.mem.pins.expire(now)
        self.arrivals.take_compiled()
        if self.limits.timed:
            for r, reason in self.limits.expired(self.queues.queued, self.running, now):
                self._finish(r, reason)
        self._preempt_for_priority()
        while not entries and (self.waiting or self.running):
            self._schedule_decodes(entries)
            self._schedule_prefills(entries)
            if not entries and (self.waiting or self.running):
                if self.lora.loads_pending:  # the adapters they wait for load first
                    break
                self.preemption.make_room(self.running, "admission")
        moves = self.mem.bridge.take_moves()
        self.spec.moved(moves)
        if not entries:
            return Scheduled(moves, None)
        self.step_no += 1
        self.budget.on_step()
        self.figures.note_used(self.mem.used_pages)
        src, dst = self.mem.copies.take()
        batch = ForwardBatch(self.step_no, entries, self.queues.freed_slots, src, dst)
        self.queues.freed_slots = []
        return Scheduled(moves, batch)

    def _schedule_decodes(self, entries: list[BatchEntry]) -> None:
        decoding = [r for r in self.running if r.is_decoding]
        while sum(self.mem.pages_needed(r, 1) for r in decoding) > self.mem.available:
            victim = self.preemption.make_room(self.running, "decode_growth")
            if victim in decoding:
                decoding.remove(victim)
        spare = self.mem.available - sum(self.mem.pages_needed(r, 1) for r in decoding)
        drafts = self.spec.plan(decoding, spare)
        self.lora.order_decodes(decoding)
        for r in decoding:
            entries.append(self.builder.entry(r, 1, drafts.get(r)))

    def _schedule_prefills(self, entries: list[BatchEntry]) -> None:
        """Fill the step's prefill budget (step_budget.py): requests still prefilling first (they always
        progress, as far as the pages allow), then waiting ones in priority and fair-share order,
        each from its longest cached prefix, keeping pages back for the running ones' growth."""
        prefilling = [r for r in self.running if not r.is_decoding]
        pending = {r.tenant for r in prefilling} | ({r.tenant for r in self.waiting} if self.queues.free_slots else set())
        tokens = StepTokens(self.step_budget, [r.kv_len for r in self.running if r.is_decoding and r.stream],
                            self.tenants.shares(pending))
        for r in prefilling:
            n = self.mem.fit_tokens(r, tokens.allow(r, r.extend_len))
            if n > 0:
                entries.append(self.builder.entry(r, n))
                tokens.spend(r, n)
        reserve = self.budget.reserve_pages(self.running)
        order = self.tenants.order(self._ordered_waiting(), self.running)
        adapters = self.lora.step(self.running)
        for r in order:
            if tokens.exhausted or not self.queues.free_slots:
                break
            if not self.lora.admissible(r, adapters):  # its adapter loads, or waits its turn
                continue
            start = self.mem.prefix_len(r) if tokens.cutting and r.extend_len > LONG_PROMPT else None  # cached
            allowed = tokens.allow(r, r.extend_len if start is None else r.seq_len - start, start)
            if allowed <= 0:  # its tenant's share of this step is spent
                continue
            a = self.admitter.admit(r, allowed, reserve, prefilling)
            if a.outcome is Outcome.NO_ROOM:
                break
            if a.outcome is Outcome.ADMITTED:
                self._start(r, adapters)
                order.took(r)
                entries.append(self.builder.entry(r, a.tokens))
                tokens.spend(r, a.tokens)
                reserve += self.budget.reserve_pages([r])
        self.step_budget.cut_steps += tokens.cut

    def _ordered_waiting(self) -> list[Req]:
        """The waiting requests by the schedule policy, the higher priorities first (stable)."""
        ordered = self.policy(self.waiting, self.mem.prefix_len)
        return sorted(ordered, key=lambda r: -r.rank) if self.priorities.enabled else ordered

    def _preempt_for_priority(self) -> None:
        """The most important waiting request finds no slot or no pages: running requests it outranks
        by more than the threshold give theirs back (by --preemption-mode), the least important and
        newest first, as many as it needs, or none when even all of them would not do."""
        if not self.priorities.enabled or not self.waiting:
            return
        top, ps = max(self.waiting, key=lambda r: r.rank), self.mem.page_size  # the first among equals
        cached = self.mem.prefix_len(top)
        first = cached + min(top.seq_len - cached, self.args.prefill_chunk)  # its first chunk's end
        short = -(-first // ps) - cached // ps + self.budget.reserve_pages(self.running) - self.mem.available
        victims, freed = [], 0
        for v in self.priorities.victims(top, self.running):
            if (self.queues.free_slots or victims) and freed >= short:
                break
            victims.append(v)
            freed += len(v.kv.pages)
        if not victims or freed < short:
            return
        for v in victims:
            logger.info("request %s (rank %d) preempts %s (rank %d)", top.rid, top.rank, v.rid, v.rank)
            self.preemption.retract(v, "priority")

    def _start(self, r: Req, adapters: StepAdapters) -> None:
        """r has its pages (from its match, or back from swap): into the running batch."""
        if r.cached_tokens < 0:  # first admission: count the hit
            r.started_at = time.monotonic()
            self.tenants.count(r.tenant, "prompt_tokens", r.prompt_len)
            self.tenants.count(r.tenant, "cached_tokens", r.kv_len)
            self.retention.count_request(r)
            r.cached_tokens = r.kv_len
            r.cached_details = cached_details(r.kv_len, r.kv.loaded, self.mem.page_size, self.mem.tiers)
            self.counters["prompt_tokens"] += r.prompt_len
            self.counters["cached_prompt_tokens"] += r.kv_len
            self.lora.count_admission(r)
        self.counters["recomputed_tokens"] += max(0, r.recompute_len - r.kv_len)
        r.recompute_len = 0
        r.slot_initialized = False
        self.figures.scheduled(r.rid)
        self.admissions += 1
        r.admitted_at = self.admissions
        self.queues.seat(r)
        self.spec.admit(r)
        self.lora.acquire(r, adapters)

    # -- results and freeing ---------------------------------------------------------------------

    def process(self, batch: BatchResult) -> None:
        """Apply the worker's result for the batch in flight (step_results.py), its times first."""
        self.costs.observe(batch, self.queues.inflight)
        self.figures.note_memory(batch.memory)
        self.results.apply(batch)

    def _finish(self, r: Req, reason: FinishReason) -> None:
        """r ends now, wherever it is (waiting, compiling its grammar, running or swapped out)."""
        r.finish = reason
        self.queues.outbox.append(ReqOutput(r.rid, [], reason, r.prompt_len, max(r.cached_tokens, 0),
                                            cached_details=r.cached_details))
        if r in self.waiting:
            self.waiting.remove(r)
        self.queues.grammars.remove(r)
        if r in self.running:
            self._release(r)
        elif r.kv.is_swapped:
            self.mem.swap.drop(r)

    def _release(self, r: Req) -> None:
        self.spec.release(r)
        self.mem.release(r)
        self.queues.unseat(r)
        self.lora.released(r)

    def stats(self) -> SchedulerStats:
        prompt, worker = self.counters["prompt_tokens"], self.worker
        pool = self.mem.stats()
        return SchedulerStats(
            **pool,
            **self.figures.stats(pool),
            **self.spot.stats(),
            page_size=self.mem.page_size,
            running=len(self.running),
            waiting=len(self.waiting),
            cache_hit_rate=self.counters["cached_prompt_tokens"] / prompt if prompt else 0.0,
            bytes_per_token=worker.bytes_per_token,
            tier_move_seconds=self.costs.tier_move_seconds,
            **self.tier_costs.stats(),
            forward_steps=self.step_no,
            **self.weights.stats(),
            **self.lora.stats(),
            **self.admitter.stats(),
            **self.outputs.stats(),
            **self.preemption.stats(),
            # what one rank allocated (get_server_info; `radixrt estimate` predicts the same figures)
            kv_pool_bytes=worker.kv_pool_bytes, page_table_bytes=worker.page_table_bytes,
            weight_bytes=worker.weight_bytes, lora_pool_bytes=worker.lora_pool_bytes,
            **self.counters,
            **self.retention.stats(self.running),
            **self.spec.stats(),
            **self.step_budget.stats(),
            requests_rejected=dict(self.limits.rejected),
            **self.tenants.stats(self.queues.queued, self.running, self.mem.cache.pages_by_owner()),
        )
