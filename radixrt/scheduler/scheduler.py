"""Scheduler: builds each step's batch and turns the worker's sampled ids into per-request
outputs. Page ownership lives in KVMemory; the other jobs are its collaborators': intake.py
checks a new request, admission.py decides whether a waiting one gets its pages, preemption.py
makes room, outputs.py reads a step's result for one request, weight_update.py holds requests
while the weights change, spot_checks.py samples quality checks.

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
from radixrt.errors import from_validation
from radixrt.messages import (
    BatchEntry,
    BatchResult,
    FinishReason,
    ForwardBatch,
    KVMove,
    LoadLoraAdapter,
    LoraLoaded,
    LoraUpdateReply,
    ReqOutput,
    SchedulerStats,
    SlotInit,
    TokenizedRequest,
    UnloadLoraAdapter,
    UpdateWeights,
    WeightsLoaded,
    WeightsUpdateReply,
    WorkerReady,
)
from radixrt.scheduler.admission import Admitter, Outcome
from radixrt.scheduler.bad_input import bad_request, internal_error, rejection, rid_of
from radixrt.scheduler.lora_requests import LoraRequests
from radixrt.scheduler.lora_slots import LoraSlots
from radixrt.retention.counters import RetentionCounters
from radixrt.retention.rules import RetentionRules
from radixrt.scheduler.budget import AdmissionBudget
from radixrt.scheduler.cache_hits import cached_details
from radixrt.scheduler.figures import SchedulerFigures
from radixrt.scheduler.grammars import GrammarWaitlist, reasoning_end_ids
from radixrt.scheduler.intake import Intake
from radixrt.scheduler.kv_memory import KVMemory
from radixrt.scheduler.kv_tiers import KVTiers
from radixrt.scheduler.logprobs import logprob_spec
from radixrt.scheduler.outputs import StepOutputs
from radixrt.scheduler.policy import SCHEDULE_POLICIES
from radixrt.scheduler.preemption import Preemption
from radixrt.scheduler.priorities import Priorities
from radixrt.scheduler.queue_limits import QueueLimits
from radixrt.scheduler.readouts import attach_readout, chunk_readout, collect_readout
from radixrt.scheduler.req import Req
from radixrt.scheduler.speculation import Draft, Speculator
from radixrt.scheduler.spot_checks import SpotChecks
from radixrt.scheduler.step_budget import LONG_PROMPT, StepBudget, StepTokens
from radixrt.scheduler.stop import StopChecker
from radixrt.scheduler.tenants import Tenants
from radixrt.scheduler.tier_costs import TierCosts
from radixrt.scheduler.weight_update import ABORTED_FOR_UPDATE, WeightUpdates
from radixrt.settings.scheduling import tenant_table

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Scheduled:
    """One schedule() decision. The worker makes the tier moves first: the batch reads pages they
    bring back, and writes pages they free."""

    moves: list[KVMove]
    batch: ForwardBatch | None


class Scheduler:
    def __init__(self, args: SchedulerConfig, worker: WorkerReady, tokenizer: Any) -> None:
        self.args = args
        tiers = None
        # load or recompute a lower tier's pages: the worker's start-up probe, then what it reports
        self.tier_costs = TierCosts(worker.h2d_s_per_page, worker.disk2d_s_per_page, worker.attention_per_position,
                                    always_load=args.hicache_load_policy == "always")
        order = EvictionOrder(args.radix_eviction_policy, self.tier_costs.relative_recompute_cost)
        if worker.host_pages:
            tiers = KVTiers(worker.host_pages, args.enable_hierarchical_cache, worker.disk_dir, worker.disk_pages,
                            worker.page_size, order, args.hicache_write_policy, self.tier_costs, args.mooncake)
        self.mem = KVMemory(worker.num_pages, worker.page_size, use_cache=not args.disable_radix_cache, tiers=tiers,
                            order=order, pinned_fraction=args.max_pinned_fraction,
                            pinned_namespace_fraction=args.max_pinned_namespace_fraction)
        self.bytes_per_token = worker.bytes_per_token
        # what one rank allocated (get_server_info; `radixrt estimate` predicts the same figures)
        self.memory_figures = {"kv_pool_bytes": worker.kv_pool_bytes, "page_table_bytes": worker.page_table_bytes,
                               "weight_bytes": worker.weight_bytes, "lora_pool_bytes": worker.lora_pool_bytes}
        self.weights = WeightUpdates(self.mem)
        self.long_prompt_threshold = worker.long_prompt_threshold
        self.stop = StopChecker(tokenizer, worker.eos_ids, worker.context_length)
        RetentionRules.for_worker(args.retention, worker)  # ValueError: this worker cannot run the server's settings
        self.retention = RetentionCounters()
        self.policy = SCHEDULE_POLICIES[args.schedule_policy]
        self.budget = AdmissionBudget(worker.page_size)
        self.waiting: list[Req] = []
        self.grammars = GrammarWaitlist(tokenizer, worker.vocab_size, worker.eos_ids, args.json_max_whitespace,
                                        reasoning_end_ids(tokenizer, args.reasoning_parser))
        self.running: list[Req] = []
        self.free_slots = list(range(args.max_running_requests - 1, -1, -1))
        self.freed_slots: list[int] = []  # to tell the worker with the next batch
        self.inflight: list[tuple[Req, int]] = []  # (request, tokens run) per entry of the batch in flight
        self.outbox: list[ReqOutput] = []
        self.step_no = 0
        self.admissions = 0
        self.counters = dict.fromkeys(("prompt_tokens", "cached_prompt_tokens", "recomputed_tokens"), 0)
        self.admitter = Admitter(self.mem)
        self.preemption = Preemption(args.preemption_mode, args.swap_min_tokens, self.mem, self.budget, self.waiting,
                                     self._release, self._finish)
        self.figures = SchedulerFigures(worker, args.tp_size)
        self.spot = SpotChecks(args.quality_spot_check_rate, args.quality_spot_check_min_agreement,
                               args.quality_spot_check_queue, args.random_seed,
                               worker.long_prompt_threshold or worker.context_length)
        self.intake = Intake(worker.page_size, worker.vocab_size, worker.context_length, worker.long_prompt_threshold,
                             self.spot, self.figures)
        self.outputs = StepOutputs(self.stop, self.spot, not args.disable_jump_forward)
        self.tier_move_seconds = 0.0
        self.spec = Speculator(args.speculative, worker.page_size, worker.context_length, worker.attention_per_position)
        self.priorities = Priorities(args.enable_priority_scheduling, args.schedule_low_priority_values_first,
                                     args.priority_scheduling_preemption_threshold, args.abort_on_priority_when_disabled)
        self.limits = QueueLimits(args.max_queued_requests, args.req_waiting_timeout, args.req_running_timeout,
                                  args.enable_priority_scheduling)
        self.tenants = Tenants(tenant_table(args.api_keys_file), args.tenant_kv_quota, worker.num_pages)
        self.mem.set_quotas(self.tenants.quota_pages if self.tenants.has_quotas else None)
        self.lora = LoraSlots(args.lora) if args.lora is not None else None  # which adapter runs from which slot
        self.lora_requests = LoraRequests(self.lora, self.mem, self._finish)
        self.step_budget = StepBudget(args.prefill_chunk, args.max_prefill_tokens, args.max_decode_slowdown,
                                      worker.attention_per_position)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running and not self.grammars

    # -- requests in and out --------------------------------------------------

    def add_request(self, msg: TokenizedRequest) -> None:
        """Queue msg, or answer it with a 400 abort when the model cannot run it. During a weight
        update it waits, unchecked, for the new weights."""
        if self.weights.hold(msg):
            return
        msg = self.lora_requests.resolve(msg)  # in its adapter's namespace, or its 400
        r = self.intake.accept(msg) if isinstance(msg, TokenizedRequest) else msg
        if not isinstance(r, ReqOutput):
            r.tenant, r.rank, r.arrived_at = self.tenants.name_of(msg), self.priorities.rank(msg.priority), time.monotonic()
            self.tenants.count(r.tenant, "requests")
            if (why := self.mem.pins.refusal(r)) is not None:
                logger.error("refused request %s: %s", r.rid, why)
                r = rejection(r.rid, why, r.prompt_len)
        if isinstance(r, ReqOutput):  # refused
            self.outbox.append(r)
            return
        if not self._queue_takes(r, msg.priority):
            return
        if r.pin_ttl is not None:
            self.mem.pins.pin(r, time.monotonic())
        if r.sampling.constraint is not None:
            self.grammars.add(r)  # it joins the waiting queue once its matcher is ready
        else:
            self.waiting.append(r)

    def _queue_takes(self, r: Req, priority: int | None) -> bool:
        """SGLang's refusals at the queue: a priority on a server without priorities (when asked),
        and a full queue (r, or under priorities a waiting request r outranks, gets the 503)."""
        refused = self.priorities.refusal(priority)
        if refused is not None:
            self.limits.rejected["priority_disabled"] += 1
            self._answer_unqueued(r, refused)
            return False
        full = self.limits.on_arrival(r, self.waiting + self.grammars.requests)
        if full is None:
            return True
        ended, reason = full
        if ended is r:
            self._answer_unqueued(r, reason)
            return False
        self.tenants.count(ended.tenant, "rejected")
        self._finish(ended, reason)
        return True

    def _answer_unqueued(self, r: Req, reason: FinishReason) -> None:
        logger.warning("refused request %s: %s", r.rid, reason.message)
        self.tenants.count(r.tenant, "rejected")
        r.finish = reason
        self.outbox.append(ReqOutput(r.rid, [], reason, r.prompt_len, 0))

    def reject_undecodable(self, raw: bytes, error: Exception) -> None:
        """A frontend message that did not decode: if it names a string rid, answer that rid
        with a 400 abort (a request held under it leaves too, as the frontend forgets it)."""
        why = f"malformed request: {from_validation(error, what='message').message}"
        rid = rid_of(raw)
        logger.error("undecodable message from the frontend (%d bytes, rid %r): %s", len(raw), rid, why)
        if rid is None:
            return
        held = self._held(rid)
        if held is None:
            self.outbox.append(rejection(rid, why))
        else:
            self._finish(held, bad_request(why))

    def abort(self, rid: str) -> None:
        held_for_update = self.weights.abort_held(rid)
        if held_for_update is not None:
            self.outbox.append(held_for_update)
            return
        r = self._held(rid)
        if r is not None:
            self._finish(r, FinishReason("abort", message="aborted by client"))

    def _held(self, rid: str) -> Req | None:
        return next((r for r in self.waiting + self.running + self.grammars.requests if r.rid == rid), None)

    def take_outputs(self) -> list[ReqOutput]:
        out, self.outbox = self.outbox, []
        self.figures.attach(out)
        return out

    def flush_cache(self) -> str | None:
        """Empty the prefix cache; returns why not when requests are in the system."""
        if not self.idle:
            return f"cannot flush the cache while {len(self.running)} running and {len(self.waiting)} waiting requests use it"
        self.mem.flush()
        self.spec.flush()
        return None

    # -- LoRA adapters (scheduler/lora_requests.py) -------------------------------------

    def load_lora(self, msg: LoadLoraAdapter) -> LoraUpdateReply:
        return self.lora_requests.load(msg, self.waiting + self.grammars.requests, self.running)

    def unload_lora(self, msg: UnloadLoraAdapter) -> LoraUpdateReply:
        return self.lora_requests.unload(msg, self.waiting + self.grammars.requests, self.running)

    def lora_loaded(self, reply: LoraLoaded) -> None:
        self.lora_requests.loaded(reply, self.waiting)

    def begin_weight_update(self, msg: UpdateWeights) -> WeightsUpdateReply | None:
        """From now on new requests wait (weight_update.py); with abort_all_requests every request in
        the system ends now. Returns a refusal when an update is already under way."""
        refusal = self.weights.begin(msg)
        if refusal is None and msg.abort_all_requests:
            for r in self.waiting + self.running + self.grammars.requests:
                self._finish(r, FinishReason("abort", message=ABORTED_FOR_UPDATE))
        return refusal

    def finish_weight_update(self, loaded: WeightsLoaded) -> WeightsUpdateReply:
        """The workers answered: the old KV goes (on success), and the held requests enter, after the reply."""
        reply, held = self.weights.finish(loaded)
        for msg in held:
            self.add_request(msg)
        return reply

    # -- the scheduling decision ----------------------------------------------

    def schedule(self) -> Scheduled:
        """The next step: the tier moves the worker makes first, and the batch (None: nothing to run).
        Run it with scheduler/step.py, which makes the moves before the batch."""
        entries: list[BatchEntry] = []
        self.inflight = []
        self.spec.step_started(time.perf_counter())
        now = time.monotonic()
        self.mem.pins.expire(now)
        self._take_compiled()
        if self.limits.timed:
            for r, reason in self.limits.expired(self.waiting + self.grammars.requests, self.running, now):
                self._finish(r, reason)
        self._preempt_for_priority()
        while not entries and (self.waiting or self.running):
            self._schedule_decodes(entries)
            self._schedule_prefills(entries)
            if not entries and (self.waiting or self.running):
                if self.lora is not None and self.lora.loads:  # the adapters they wait for load first
                    break
                self.preemption.make_room(self.running, "admission")
        moves = self.mem.take_moves()
        self.spec.moved(moves)
        if not entries:
            return Scheduled(moves, None)
        self.step_no += 1
        self.budget.on_step()
        self.figures.note_used(self.mem.used_pages)
        src, dst = self.mem.take_copies()
        batch = ForwardBatch(self.step_no, entries, self.freed_slots, src, dst)
        self.freed_slots = []
        return Scheduled(moves, batch)

    def _take_compiled(self) -> None:
        """Requests whose grammar is compiled join the waiting queue; a refused grammar ends its request."""
        ready, ended = self.grammars.take_ready()
        for r, reason in ended:
            self._finish(r, reason)
        self.waiting += ready

    def _schedule_decodes(self, entries: list[BatchEntry]) -> None:
        decoding = [r for r in self.running if r.is_decoding]
        while sum(self.mem.pages_needed(r, 1) for r in decoding) > self.mem.available:
            victim = self.preemption.make_room(self.running, "decode_growth")
            if victim in decoding:
                decoding.remove(victim)
        spare = self.mem.available - sum(self.mem.pages_needed(r, 1) for r in decoding)
        drafts = self.spec.plan(decoding, spare)
        if self.lora is not None:  # each adapter's decode rows in one run (models/lora.py reads them as a slice)
            decoding.sort(key=lambda r: r.lora_slot)
        for r in decoding:
            entries.append(self._entry(r, 1, drafts.get(r)))

    def _schedule_prefills(self, entries: list[BatchEntry]) -> None:
        """Fill the step's prefill budget (step_budget.py): requests still prefilling first (they always
        progress, as far as the pages allow), then waiting ones in priority and fair-share order,
        each from its longest cached prefix, keeping pages back for the running ones' growth."""
        prefilling = [r for r in self.running if not r.is_decoding]
        pending = {r.tenant for r in prefilling} | ({r.tenant for r in self.waiting} if self.free_slots else set())
        tokens = StepTokens(self.step_budget, [r.kv_len for r in self.running if r.is_decoding and r.stream],
                            self.tenants.shares(pending))
        for r in prefilling:
            n = self.mem.fit_tokens(r, tokens.allow(r, r.extend_len))
            if n > 0:
                entries.append(self._entry(r, n))
                tokens.spend(r, n)
        reserve = self.budget.reserve_pages(self.running)
        order = self.tenants.order(self._ordered_waiting(), self.running)
        adapters = self.lora.step(self.running) if self.lora is not None else None
        for r in order:
            if tokens.exhausted or not self.free_slots:
                break
            if adapters is not None and not self.lora.admissible(r, adapters):  # its adapter loads, or waits its turn
                continue
            start = self.mem.prefix_len(r) if tokens.cutting and r.extend_len > LONG_PROMPT else None  # cached
            allowed = tokens.allow(r, r.extend_len if start is None else r.seq_len - start, start)
            if allowed <= 0:  # its tenant's share of this step is spent
                continue
            a = self.admitter.admit(r, allowed, reserve, prefilling)
            if a.outcome is Outcome.NO_ROOM:
                break
            if a.outcome is Outcome.ADMITTED:
                self._start(r)
                if adapters is not None:
                    r.lora_slot = self.lora.acquire(r, adapters)
                order.took(r)
                entries.append(self._entry(r, a.tokens))
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
            if (self.free_slots or victims) and freed >= short:
                break
            victims.append(v)
            freed += len(v.kv.pages)
        if not victims or freed < short:
            return
        for v in victims:
            logger.info("request %s (rank %d) preempts %s (rank %d)", top.rid, top.rank, v.rid, v.rank)
            self.preemption.retract(v, "priority")

    def _start(self, r: Req) -> None:
        """r has its pages (from its match, or back from swap): into the running batch."""
        self.waiting.remove(r)
        if r.cached_tokens < 0:  # first admission: count the hit
            r.started_at = time.monotonic()
            self.tenants.count(r.tenant, "prompt_tokens", r.prompt_len)
            self.tenants.count(r.tenant, "cached_tokens", r.kv_len)
            self.retention.count_request(r)
            r.cached_tokens = r.kv_len
            r.cached_details = cached_details(r.kv_len, r.kv.loaded, self.mem.page_size, self.mem.tiers)
            self.counters["prompt_tokens"] += r.prompt_len
            self.counters["cached_prompt_tokens"] += r.kv_len
            self.lora_requests.count_admission(r)
        self.counters["recomputed_tokens"] += max(0, r.recompute_len - r.kv_len)
        r.recompute_len = 0
        r.slot = self.free_slots.pop()
        r.slot_initialized = False
        self.figures.scheduled(r.rid)
        self.admissions += 1
        r.admitted_at = self.admissions
        self.running.append(r)
        self.spec.admit(r)

    def _entry(self, r: Req, n: int, draft: Draft | None = None) -> BatchEntry:
        """r runs its next n tokens (and verifies `draft`, when it has one) in this step."""
        start, dropped = r.kv_len, r.kv.dropped
        k = draft.length if draft is not None else 0
        retain = self.mem.retain(r, n) if r.retention is not None else None
        new_pages = self.mem.grow(r, n + k)
        self.spec.wrote(r, r.kv.pages[r.kv.kv_len // self.mem.page_size :])
        self.retention.after_growth(r, (r.kv.dropped - dropped) // self.mem.page_size)
        sample = start + n == r.seq_len and r.sampling.max_new_tokens > 0
        init = None
        if not r.slot_initialized:
            penalty_ids = r.prompt_ids if r.sampling.repetition_penalty != 1 else []
            init = SlotInit(r.sampling, self.stop.stop_ids(r), penalty_ids, list(r.output_ids), r.long_rope,
                            r.lora_slot)
        self.inflight.append((r, n))
        if r.spec is not None:
            r.spec.pending, r.spec.branched = k, bool(draft is not None and draft.parents)
        allowed = r.grammar.allowed() if sample and r.grammar is not None else b""
        drafted = draft.tokens if draft is not None else []
        return BatchEntry(slot=r.slot, input_ids=r.tokens(start, start + n) + drafted, start_pos=r.kv.kv_len,
                          new_pages=new_pages, sample=sample, init=init, logprobs=logprob_spec(r, start, n),
                          allowed=allowed, pos_offset=r.kv.dropped, retain=retain,
                          want_mass=r.retention is not None and r.retention.wants_mass, draft_len=len(drafted),
                          propose=draft.propose if draft is not None else 0,
                          draft_parents=draft.parents if draft is not None else [], readout=chunk_readout(r, start, n))

    # -- results ---------------------------------------------------------------

    def process(self, batch: BatchResult) -> None:
        """Apply the worker's result for the batch in flight. An entry the worker reports
        failed, or whose outputs raise here, finishes its request alone (abort, status 500)."""
        self._observe_costs(batch)
        self.figures.note_memory(batch.memory)
        failed = {e.entry: e.message for e in batch.errors}
        # entry -> whether it sampled; first, before anything is cached
        lost = self.preemption.recompute_lost(batch.disk, self.running, self.inflight)
        ids, verdicts = iter(batch.next_ids), iter(batch.spec)  # failed entries have neither
        for i, (r, n) in enumerate(self.inflight):
            drafts, sampled = r.spec.pending if r.spec is not None else 0, r.kv_len + n == r.seq_len
            verdict = next(verdicts) if drafts and i not in failed else None
            if i in lost:  # its step read KV a disk load could not provide: thrown away, r runs again
                if lost[i] and i not in failed:
                    next(ids)
                continue
            if i in failed:
                # Its KV of this step is not trusted: kv_len stays, so release() caches only the
                # KV of earlier steps and frees the pages this step allocated.
                logger.error("request %s failed in step %d: %s", r.rid, self.step_no, failed[i])
                self._finish(r, internal_error(failed[i]))
                continue
            if batch.readouts:
                collect_readout(r, batch.readouts[i], r.kv_len)
            self.mem.advance(r, n + (verdict.accepted if verdict is not None else 0))  # and the drafts it keeps
            r.slot_initialized = True
            if batch.page_mass and batch.page_mass[i]:
                self.mem.add_mass(r, batch.page_mass[i])
            tokens = [next(ids)] if sampled and r.sampling.max_new_tokens > 0 else []
            if verdict is not None:
                self.spec.verified(r, verdict)
                tokens = verdict.kept() + tokens
            try:
                out = self.outputs.after_step(r, batch.logprobs[i] if batch.logprobs else None, tokens)
            except Exception as e:  # a bug met by this request only (stop check, logprobs): fail it alone
                logger.exception("request %s failed after step %d", r.rid, self.step_no)
                self._finish(r, internal_error(f"{type(e).__name__}: {e}"))
                continue
            if verdict is not None:
                self.mem.keep_to(r, r.seq_len)
            if out is not None:
                attach_readout(r, out)
                self.spec.gained(r, out.new_ids, n == 1 and r.output_len > len(out.new_ids))
                out.spec = r.spec.counts() if r.spec is not None else None
                self.outbox.append(out)
            if r.finish is not None:
                self.spot.on_finish(r)
                self._release(r)
            elif self.long_prompt_threshold and not r.long_rope and r.seq_len > self.long_prompt_threshold:
                self.preemption.recompute_under_long_rope(r)
            elif n > 1:
                self.mem.cache_progress(r)  # a prefill chunk: share its full pages now
        self.inflight = []

    def _observe_costs(self, batch: BatchResult) -> None:
        """The worker's times (before the batch is applied): each kind of tier move, and the step
        when it ran a prefill chunk, with the positions its tokens attended (from their pages)."""
        for t in batch.move_times:
            self.tier_move_seconds += t.seconds
            self.tier_costs.observe_moves(t.kind, t.pages, t.seconds)
        self.step_budget.observe([(r.kv.kv_len, n) for r, n in self.inflight], batch.forward_seconds)
        if any(n > 1 for _, n in self.inflight):
            tokens = sum(n for _, n in self.inflight)
            attended = sum(n * r.kv.kv_len + n * (n + 1) // 2 for r, n in self.inflight)
            self.tier_costs.observe_prefill(tokens, batch.forward_seconds, attended)
        elif self.inflight:  # decodes only: the step's cost by its work, drafts included (speculation.py)
            self.spec.observe_step(self.inflight, batch.forward_seconds)

    # -- freeing ---------------------------------------------------------------

    def _finish(self, r: Req, reason: FinishReason) -> None:
        """r ends now, wherever it is (waiting, compiling its grammar, running or swapped out)."""
        r.finish = reason
        self.outbox.append(ReqOutput(r.rid, [], reason, r.prompt_len, max(r.cached_tokens, 0),
                                     cached_details=r.cached_details))
        if r in self.waiting:
            self.waiting.remove(r)
        self.grammars.remove(r)
        if r in self.running:
            self._release(r)
        elif r.kv.is_swapped:
            self.mem.drop_swap(r)

    def _release(self, r: Req) -> None:
        self.spec.release(r)
        self.mem.release(r)
        self.running.remove(r)
        self.lora_requests.released(r, self.running)
        self.free_slots.append(r.slot)
        self.freed_slots.append(r.slot)
        r.slot = None

    def stats(self) -> SchedulerStats:
        prompt = self.counters["prompt_tokens"]
        pool = self.mem.stats()
        return SchedulerStats(
            **pool,
            **self.figures.stats(pool),
            **self.spot.stats(),
            page_size=self.mem.page_size,
            running=len(self.running),
            waiting=len(self.waiting),
            cache_hit_rate=self.counters["cached_prompt_tokens"] / prompt if prompt else 0.0,
            bytes_per_token=self.bytes_per_token,
            tier_move_seconds=self.tier_move_seconds,
            **self.tier_costs.stats(),
            forward_steps=self.step_no,
            **self.weights.stats(),
            **self.lora_requests.stats(),
            **self.admitter.stats(),
            **self.outputs.stats(),
            **self.preemption.stats(),
            **self.memory_figures,
            **self.counters,
            **self.retention.stats(self.running),
            **self.spec.stats(),
            **self.step_budget.stats(),
            requests_rejected=dict(self.limits.rejected),
            **self.tenants.stats(self.waiting + self.grammars.requests, self.running, self.mem.cached_pages_by_owner()),
        )
