"""Scheduler: admits requests, builds each step's batch, and turns the worker's
sampled ids into per-request outputs. Page ownership lives in KVMemory.

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

import enum
import logging
from dataclasses import dataclass
from typing import Any

from radixrt.config import ServerArgs
from radixrt.errors import RequestError, from_validation
from radixrt.messages import (
    BatchEntry,
    BatchResult,
    DiskFaults,
    EntryLogprobs,
    FinishReason,
    ForwardBatch,
    KVMove,
    ReqOutput,
    SchedulerStats,
    SlotInit,
    SpotCheck,
    SpotCheckResult,
    TokenizedRequest,
    UpdateWeights,
    WeightsLoaded,
    WeightsUpdateReply,
    WorkerReady,
)
from radixrt.scheduler.bad_input import (
    bad_request,
    internal_error,
    rejection,
    request_problem,
    rid_of,
)
from radixrt.scheduler.budget import AdmissionBudget
from radixrt.scheduler.figures import SchedulerFigures
from radixrt.scheduler.grammars import GrammarWaitlist
from radixrt.scheduler.jump_forward import can_jump, jump
from radixrt.scheduler.kv_memory import KVMemory
from radixrt.scheduler.kv_tiers import KVTiers
from radixrt.scheduler.logprobs import (
    attach_output_logprobs,
    attach_prompt_logprobs,
    collect_prompt_logprobs,
    logprob_spec,
)
from radixrt.scheduler.policy import SCHEDULE_POLICIES
from radixrt.scheduler.preemption import Preemption
from radixrt.scheduler.req import Req, longrope_namespace
from radixrt.scheduler.retained_kv import add_mass
from radixrt.scheduler.retention_rules import RetentionRules
from radixrt.scheduler.spot_checks import SpotChecks
from radixrt.scheduler.stop import StopChecker
from radixrt.scheduler.weight_update import ABORTED_FOR_UPDATE, PendingUpdate

logger = logging.getLogger(__name__)
GRAMMAR_POLL_MS = 5  # how often a scheduler with only compiling grammars looks for them


class Outcome(enum.Enum):
    ADMITTED = enum.auto()  # into the running batch
    WAIT = enum.auto()  # a request computing its prefix runs first; it waits a step and hits the cache
    NO_ROOM = enum.auto()  # its pages do not fit: it, and every later request in policy order, waits


@dataclass(frozen=True)
class Admission:
    """What trying to admit one waiting request came to."""

    outcome: Outcome
    tokens: int = 0  # admitted: the tokens it runs this step


WAIT, NO_ROOM = Admission(Outcome.WAIT), Admission(Outcome.NO_ROOM)


@dataclass(frozen=True)
class Scheduled:
    """One schedule() decision. The worker makes the tier moves first: the batch reads pages they
    bring back, and writes pages they free."""

    moves: list[KVMove]
    batch: ForwardBatch | None


class Scheduler:
    SHARE_PROBE = 32  # tokens compared to detect two waiting requests sharing an uncached prefix

    def __init__(self, args: ServerArgs, worker: WorkerReady, tokenizer: Any) -> None:
        self.args = args
        tiers = None
        if worker.host_pages:
            tiers = KVTiers(worker.host_pages, args.enable_hierarchical_cache, worker.disk_dir, worker.disk_pages)
        self.mem = KVMemory(worker.num_pages, worker.page_size, use_cache=not args.disable_radix_cache, tiers=tiers)
        self.bytes_per_token = worker.bytes_per_token
        # what one rank allocated (get_server_info; `radixrt estimate` predicts the same figures)
        self.memory_figures = {"kv_pool_bytes": worker.kv_pool_bytes, "page_table_bytes": worker.page_table_bytes,
                               "weight_bytes": worker.weight_bytes}
        self.update: PendingUpdate | None = None  # a weight update waiting for the old weights' requests
        self.vocab_size = worker.vocab_size
        self.long_prompt_threshold = worker.long_prompt_threshold
        self.stop = StopChecker(tokenizer, worker.eos_ids, worker.context_length)
        self.retention = RetentionRules(args.retention, worker)
        self.policy = SCHEDULE_POLICIES[args.schedule_policy]
        self.jump_forward = not args.disable_jump_forward
        self.budget = AdmissionBudget(worker.page_size)
        self.waiting: list[Req] = []
        self.grammars = GrammarWaitlist(tokenizer, worker.vocab_size, worker.eos_ids,
                                        not args.constrained_json_disable_any_whitespace)
        self.running: list[Req] = []
        self.free_slots = list(range(args.max_running_requests - 1, -1, -1))
        self.freed_slots: list[int] = []  # to tell the worker with the next batch
        self.inflight: list[tuple[Req, int]] = []  # (request, tokens run) per entry of the batch in flight
        self.outbox: list[ReqOutput] = []
        self.step_no = 0
        self.admissions = 0
        self.counters = dict.fromkeys(
            ("prompt_tokens", "cached_prompt_tokens", "swaps_in", "recomputed_tokens", "jump_forward_tokens",
             "weight_updates", "requests_refused_no_memory"), 0
        )
        self.preemption = Preemption(args.preemption_mode, args.swap_min_tokens, self.mem, self.budget, self.waiting,
                                     self._release)
        self.figures = SchedulerFigures(worker, args.tp_size)
        self.spot = SpotChecks(args.quality_spot_check_rate, args.quality_spot_check_min_agreement,
                               args.quality_spot_check_queue, args.random_seed,
                               worker.long_prompt_threshold or worker.context_length)
        self.tier_move_seconds = 0.0

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running and not self.grammars

    @property
    def poll_ms(self) -> int | None:
        """How long the loop may block for new messages: forever when idle, not at all with work
        to run (or a spot check to run in idle time), a little while only grammars are compiling."""
        if self.waiting or self.running or self.spot_check_due:
            return 0
        return GRAMMAR_POLL_MS if self.grammars else None

    # -- requests in and out --------------------------------------------------

    def add_request(self, msg: TokenizedRequest) -> None:
        """Queue msg, or answer it with a 400 abort when the model cannot run it. During a weight
        update it waits, unchecked, for the new weights."""
        if self.update is not None:
            self.update.held.append(msg)
            return
        budget, why = self.retention.budget(msg.sampling.kv_retention)
        if why is None:  # a request under a retention policy is not bounded by the context
            why = request_problem(msg, self.vocab_size, self.stop.context_length if budget is None else None)
        if why is not None:
            logger.error("refused request %s: %s", msg.rid, why)
            self.outbox.append(rejection(msg.rid, why, len(msg.input_ids)))
            return
        r = Req.from_msg(msg)
        r.retention = budget
        self.spot.sample(r)
        self.figures.arrived(r.rid)
        if self.long_prompt_threshold:  # a longrope model: long prompts' KV is not short prompts'
            r.long_rope = r.prompt_len > self.long_prompt_threshold
            r.namespace = longrope_namespace(r.namespace, r.long_rope)
        if r.sampling.constraint is not None:
            self.grammars.add(r)  # it joins the waiting queue once its matcher is ready
        else:
            self.waiting.append(r)

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
            self._drop(held, bad_request(why))

    def abort(self, rid: str) -> None:
        reason = FinishReason("abort", message="aborted by client")
        waiting_for_update = self.update.release(rid) if self.update is not None else None
        if waiting_for_update is not None:
            self.outbox.append(ReqOutput(rid, [], reason, len(waiting_for_update.input_ids)))
            return
        r = self._held(rid)
        if r is not None:
            self._drop(r, reason)

    def _held(self, rid: str) -> Req | None:
        compiling = [r for r, _ in self.grammars.pending]
        return next((r for r in self.waiting + self.running + compiling if r.rid == rid), None)

    def _drop(self, r: Req, reason: FinishReason) -> None:
        if r in self.waiting:
            self.waiting.remove(r)
        self.grammars.remove(r)
        self._finish(r, reason)

    def _take_compiled(self) -> None:
        """Requests whose grammar is compiled join the waiting queue; a refused grammar ends its request."""
        for r, matcher in self.grammars.take_ready():
            if isinstance(matcher, RequestError):
                self._finish(r, bad_request(matcher.message))
            elif isinstance(matcher, BaseException):
                logger.error("compiling the grammar of %s failed: %r", r.rid, matcher)
                self._finish(r, internal_error(f"compiling the grammar failed: {type(matcher).__name__}: {matcher}"))
            else:
                r.grammar = matcher
                self.waiting.append(r)

    def take_outputs(self) -> list[ReqOutput]:
        out, self.outbox = self.outbox, []
        self.figures.attach(out)
        return out

    # -- quality spot checks, in idle time --------------------------------------

    @property
    def spot_check_due(self) -> bool:
        """A spot check's next chunk may run: it has one, and no live request waits for the workers."""
        return self.spot.has_work and self.idle and self.update is None

    def next_spot_check(self) -> SpotCheck:
        return self.spot.next_message()

    def spot_checked(self, res: SpotCheckResult) -> None:
        self.spot.record(res)
        self.figures.note_memory(res.memory)

    def flush_cache(self) -> str | None:
        """Empty the prefix cache; returns why not when requests are in the system."""
        if not self.idle:
            return f"cannot flush the cache while {len(self.running)} running and {len(self.waiting)} waiting requests use it"
        self.mem.flush()
        return None

    # -- weight updates ---------------------------------------------------------

    def begin_weight_update(self, msg: UpdateWeights) -> WeightsUpdateReply | None:
        """From now on new requests wait; with abort_all_requests every request in the system ends
        now. Returns a refusal when an update is already under way."""
        if self.update is not None:
            return WeightsUpdateReply(msg.query_id, False, "another weight update is in progress")
        if msg.abort_all_requests:
            compiling = [r for r, _ in self.grammars.pending]
            for r in self.waiting + self.running + compiling:
                self._drop(r, FinishReason("abort", message=ABORTED_FOR_UPDATE))
        self.update = PendingUpdate(msg)
        return None

    @property
    def update_due(self) -> bool:
        """A weight update waits and the old weights' requests are all done: the workers may load."""
        return self.update is not None and self.idle

    def finish_weight_update(self, loaded: WeightsLoaded) -> WeightsUpdateReply:
        """The workers answered. On success every page computed with the old weights leaves the
        device and host tiers, and the disk tier moves to the new weights' directory (the old one
        stays on disk for a rollback). Either way the held requests enter now, after the reply."""
        upd, self.update = self.update, None
        assert upd is not None, "WeightsLoaded without a pending update"
        if loaded.success:
            self.mem.flush()
            if self.mem.tiers is not None and self.mem.tiers.disk is not None:  # "": the tier turned off
                self.mem.tiers.switch_disk(loaded.disk_dir, loaded.disk_pages)
            self.counters["weight_updates"] += 1
        else:
            logger.error("weight update from %s refused: %s", upd.msg.model_path, loaded.message)
        reply = WeightsUpdateReply(upd.msg.query_id, loaded.success, loaded.message, loaded.weights_fingerprint,
                                   len(upd.held))
        for msg in upd.held:
            self.add_request(msg)
        return reply

    # -- the scheduling decision ----------------------------------------------

    def schedule(self) -> Scheduled:
        """The next step: the tier moves the worker makes first, and the batch (None: nothing to run).
        Run it with scheduler/step.py, which makes the moves before the batch."""
        entries: list[BatchEntry] = []
        self.inflight = []
        self._take_compiled()
        while not entries and (self.waiting or self.running):
            self._schedule_decodes(entries)
            self._schedule_prefills(entries)
            if not entries and (self.waiting or self.running):
                self._make_room("admission")
        if not entries:
            return Scheduled(self.mem.take_moves(), None)
        self.step_no += 1
        self.budget.on_step()
        self.figures.note_used(self.mem.used_pages)
        src, dst = self.mem.take_copies()
        batch = ForwardBatch(self.step_no, entries, self.freed_slots, src, dst)
        self.freed_slots = []
        return Scheduled(self.mem.take_moves(), batch)

    def _schedule_decodes(self, entries: list[BatchEntry]) -> None:
        decoding = [r for r in self.running if r.is_decoding]
        while sum(self.mem.pages_needed(r, 1) for r in decoding) > self.mem.available:
            victim = self._make_room("decode_growth")
            if victim in decoding:
                decoding.remove(victim)
        for r in decoding:
            entries.append(self._entry(r, 1))

    def _schedule_prefills(self, entries: list[BatchEntry]) -> None:
        token_budget = self.args.prefill_chunk
        # Admitted requests always progress, by as much as the available pages allow.
        for r in [r for r in self.running if not r.is_decoding]:
            n = self.mem.fit_tokens(r, min(r.extend_len, token_budget))
            if n > 0:
                entries.append(self._entry(r, n))
                token_budget -= n
        # New requests come in whole chunks, keeping pages back for the running ones' growth.
        reserve = self.budget.reserve_pages(self.running)
        computing = [r for r in self.running if not r.is_decoding]  # their uncached tokens are being computed
        for r in self.policy(self.waiting, self.mem.prefix_len):
            if token_budget <= 0 or not self.free_slots:
                break
            if r.kv.is_swapped:
                a = self._admit_swapped(r, token_budget, reserve)
            else:
                a = self._admit_waiting(r, token_budget, reserve, computing)
            if a.outcome is Outcome.NO_ROOM:
                break
            if a.outcome is Outcome.ADMITTED:
                entries.append(self._entry(r, a.tokens))
                token_budget -= a.tokens
                reserve += self.budget.reserve_pages([r])

    def _admit_waiting(self, r: Req, token_budget: int, reserve: int, computing: list[Req]) -> Admission:
        """Admit r from its longest cached prefix, unless it should wait or does not fit."""
        m = self.mem.match(r)
        if self._shares_uncached_prefix(r, m.matched_len, computing):
            return WAIT
        if not self.mem.admit(r, m, min(r.seq_len - m.matched_len, token_budget), reserve):
            return NO_ROOM
        self._start(r)
        computing.append(r)
        n = min(r.extend_len, token_budget)
        return Admission(Outcome.ADMITTED, r.retention.first_tokens(r.kv_len, n) if r.retention else n)

    def _admit_swapped(self, r: Req, token_budget: int, reserve: int) -> Admission:
        """Bring a swapped-out r back from host memory, if its pages fit."""
        n = min(r.seq_len - r.kv.swapped_len, token_budget)
        if self.mem.swap_in_pages(r, n) + reserve > self.mem.available:
            return NO_ROOM
        self.mem.swap_in(r)
        self.counters["swaps_in"] += 1
        self._start(r)
        return Admission(Outcome.ADMITTED, n)

    def _shares_uncached_prefix(self, r: Req, matched: int, computing: list[Req]) -> bool:
        """A request still prefilling will compute r's next tokens: wait for them and hit the cache."""
        end = matched + self.SHARE_PROBE
        if r.seq_len < end + 1:
            return False
        probe = r.tokens(0, end)
        return any(a.namespace == r.namespace and a.seq_len > end and a.tokens(0, end) == probe for a in computing)

    def _make_room(self, cause: str) -> Req | None:
        """Nothing fits: a running request gives its pages back (preemption.py; cause: RETRACTION_CAUSES),
        or, with none running, the first waiting one is refused (it cannot fit even an empty pool)."""
        if self.running:
            victim = self.preemption.victim(self.running)
            if len(self.running) == 1:
                self.counters["requests_refused_no_memory"] += 1
                self._finish(victim, FinishReason("abort", message="the KV pool is too small for this sequence"))
            else:
                self.preemption.retract(victim, cause)
            return victim
        r = self.waiting.pop(0)
        pool = self.mem.num_pages
        self.counters["requests_refused_no_memory"] += 1
        self._finish(r, FinishReason("abort", message=f"the prompt needs more KV pages than the pool's {pool}"))
        return r

    def _start(self, r: Req) -> None:
        """r has its pages (from its match, or back from swap): into the running batch."""
        self.waiting.remove(r)
        if r.cached_tokens < 0:  # first admission: count the hit
            self.retention.count_request(r)
            r.cached_tokens = r.kv_len
            self.counters["prompt_tokens"] += r.prompt_len
            self.counters["cached_prompt_tokens"] += r.kv_len
        self.counters["recomputed_tokens"] += max(0, r.recompute_len - r.kv_len)
        r.recompute_len = 0
        r.slot = self.free_slots.pop()
        r.slot_initialized = False
        self.figures.scheduled(r.rid)
        self.admissions += 1
        r.admitted_at = self.admissions
        self.running.append(r)

    def _entry(self, r: Req, n: int) -> BatchEntry:
        start, dropped = r.kv_len, r.kv.dropped
        retain = self.mem.retain(r, n) if r.retention is not None else None
        new_pages = self.mem.grow(r, n)
        self.retention.after_growth(r, (r.kv.dropped - dropped) // self.mem.page_size)
        sample = start + n == r.seq_len and r.sampling.max_new_tokens > 0
        init = None
        if not r.slot_initialized:
            penalty_ids = r.prompt_ids if r.sampling.repetition_penalty != 1 else []
            init = SlotInit(r.sampling, self.stop.stop_ids(r), penalty_ids, list(r.output_ids), r.long_rope)
        self.inflight.append((r, n))
        allowed = r.grammar.allowed() if sample and r.grammar is not None else b""
        return BatchEntry(slot=r.slot, input_ids=r.tokens(start, start + n), start_pos=r.kv.kv_len, new_pages=new_pages,
                          sample=sample, init=init, logprobs=logprob_spec(r, start, n), allowed=allowed,
                          pos_offset=r.kv.dropped, retain=retain,
                          want_mass=r.retention is not None and r.retention.wants_mass)

    # -- results ---------------------------------------------------------------

    def process(self, batch: BatchResult) -> None:
        """Apply the worker's result for the batch in flight. An entry the worker reports
        failed, or whose outputs raise here, finishes its request alone (abort, status 500)."""
        self.tier_move_seconds += batch.move_seconds
        self.figures.note_memory(batch.memory)
        failed = {e.entry: e.message for e in batch.errors}
        lost = self._recompute_lost(batch.disk)  # entry -> whether it sampled; first, before anything is cached
        ids = iter(batch.next_ids)  # failed entries have none
        for i, (r, n) in enumerate(self.inflight):
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
            self.mem.advance(r, n)
            r.slot_initialized = True
            if batch.page_mass and batch.page_mass[i]:
                add_mass(r, batch.page_mass[i])
            next_id = next(ids) if r.kv_len == r.seq_len and r.sampling.max_new_tokens > 0 else None
            try:
                out = self._advance(r, batch.logprobs[i] if batch.logprobs else None, next_id)
            except Exception as e:  # a bug met by this request only (stop check, logprobs): fail it alone
                logger.exception("request %s failed after step %d", r.rid, self.step_no)
                self._finish(r, internal_error(f"{type(e).__name__}: {e}"))
                continue
            if out is not None:
                self.outbox.append(out)
            if r.finish is not None:
                self.spot.on_finish(r)
                self._release(r)
            elif self.long_prompt_threshold and not r.long_rope and r.seq_len > self.long_prompt_threshold:
                self.preemption.recompute_under_long_rope(r)
            elif n > 1:
                self.mem.cache_progress(r)  # a prefill chunk: share its full pages now
        self.inflight = []

    def _recompute_lost(self, faults: DiskFaults | None) -> dict[int, bool]:
        """The disk tier's failures in this step's moves: their pages leave its index, and a running
        request whose page table holds a page a failed read left without KV gives its pages back
        and runs its sequence again (a cache miss: same tokens, more compute); the pages leave the
        prefix cache. Returns its in-flight entries, each with whether the worker sampled for it."""
        if faults is None or self.mem.tiers is None:
            return {}
        self.mem.tiers.disk_failed(faults)
        pages = set(faults.lost_pages)
        lost = [r for r in self.running if pages.intersection(r.kv.pages)]
        entries = {i: r.kv_len + n == r.seq_len and r.sampling.max_new_tokens > 0
                   for i, (r, n) in enumerate(self.inflight) if r in lost}
        if lost:
            logger.warning("recomputing %d requests: the disk KV tier could not load %d of their pages",
                           len(lost), len(pages))
        for r in lost:
            self.preemption.requeue_to_recompute(r)
        self.mem.forget(pages)
        return entries

    def _advance(self, r: Req, lp: EntryLogprobs | None, next_id: int | None) -> ReqOutput | None:
        """r after a step that ran (next_id: its sampled token, if any): its output, finish, logprobs."""
        collect_prompt_logprobs(r, lp)
        out = ReqOutput(r.rid, [], prompt_tokens=r.prompt_len, cached_tokens=max(r.cached_tokens, 0))
        attach_prompt_logprobs(r, out)
        if next_id is not None:
            r.output_ids.append(next_id)
            out.new_ids = [next_id]
            attach_output_logprobs(lp, out)
            self.spot.note_output(r, lp)
            if r.grammar is not None and not r.grammar.accept(next_id):
                raise RuntimeError(f"sampled token {next_id}, which its grammar does not allow")
            r.finish = self._finish_after(r, 1)
            if r.finish is None and self.jump_forward and can_jump(r):
                forced = jump(r, self.stop.tokenizer)  # run in the next step, like a prefill chunk
                if forced:
                    out.new_ids += forced
                    self.counters["jump_forward_tokens"] += len(forced)
                    r.finish = self._finish_after(r, len(forced) + 1)
        elif r.kv_len == r.seq_len:  # a prefill-only request (max_new_tokens 0) is done
            r.finish = FinishReason("length", length=0)
        if out.new_ids or out.input_logprobs is not None or r.finish is not None:
            out.finish = r.finish
            return out
        return None

    def _finish_after(self, r: Req, new: int) -> FinishReason | None:
        """r's finish after it gained `new` output tokens: a stop id or string, its length, or
        its grammar with nothing left to follow (matched: the stop token, if one ended it)."""
        finish = self.stop.check(r, new)
        if finish is None and r.grammar is not None and r.grammar.finished:
            finish = FinishReason("stop", matched=r.output_ids[-1] if r.grammar.terminated else None)
        return finish

    # -- freeing ---------------------------------------------------------------

    def _finish(self, r: Req, reason: FinishReason) -> None:
        r.finish = reason
        self.outbox.append(ReqOutput(r.rid, [], reason, r.prompt_len, max(r.cached_tokens, 0)))
        if r in self.running:
            self._release(r)
        elif r.kv.is_swapped:
            self.mem.drop_swap(r)

    def _release(self, r: Req) -> None:
        self.mem.release(r)
        self.running.remove(r)
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
            forward_steps=self.step_no,
            weight_update_pending=int(self.update is not None),
            held_for_weight_update=len(self.update.held) if self.update is not None else 0,
            **self.preemption.stats(),
            **self.memory_figures,
            **self.counters,
            **self.retention.stats(self.running),
        )
