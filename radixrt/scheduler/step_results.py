"""StepResults: the worker's result for the batch in flight, applied. Per entry the request's KV
advances (by the drafts it kept too), what it read out is kept (readouts.py), its sampled token
joins its output (outputs.py says what that means), and a finished request leaves the running
batch (step_costs.py takes the step's measured times first).

An entry the worker reports failed, or whose outputs raise here, finishes its request alone
(abort, status 500); an entry whose step read KV a failed disk load could not provide is thrown
away, and its request runs again (preemption.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from radixrt.messages import BatchResult, FinishReason, SpecVerdict
from radixrt.scheduler.bad_input import internal_error
from radixrt.scheduler.kv_memory import KVMemory
from radixrt.scheduler.outputs import StepOutputs
from radixrt.scheduler.preemption import Preemption
from radixrt.scheduler.queues import Queues
from radixrt.scheduler.readouts import collect_readout
from radixrt.scheduler.req import Req
from radixrt.scheduler.speculation import Speculator
from radixrt.scheduler.spot_checks import SpotChecks

logger = logging.getLogger(__name__)


class StepResults:
    def __init__(self, queues: Queues, mem: KVMemory, outputs: StepOutputs, spec: Speculator, spot: SpotChecks,
                 preemption: Preemption, long_prompt_threshold: int, finish: Callable[[Req, FinishReason], None],
                 release: Callable[[Req], None]) -> None:
        """long_prompt_threshold: a longrope model's original context (0: not a longrope model);
        finish and release: the scheduler's (end a request; take it out of the running batch)."""
        self.queues, self.mem, self.outputs, self.spec, self.spot = queues, mem, outputs, spec, spot
        self.preemption, self.long_prompt_threshold = preemption, long_prompt_threshold
        self.finish, self.release = finish, release

    def apply(self, batch: BatchResult) -> None:
        """Apply the worker's result for the batch in flight."""
        failed = {e.entry: e.message for e in batch.errors}
        # entry -> whether it sampled; first, before anything is cached
        lost = self.preemption.recompute_lost(batch.disk, self.queues.running, self.queues.inflight)
        ids, verdicts = iter(batch.next_ids), iter(batch.spec)  # failed entries have neither
        for i, (r, n) in enumerate(self.queues.inflight):
            drafts, sampled = r.spec.pending if r.spec is not None else 0, r.kv_len + n == r.seq_len
            verdict = next(verdicts) if drafts and i not in failed else None
            if i in lost:  # its step read KV a disk load could not provide: thrown away, r runs again
                if lost[i] and i not in failed:
                    next(ids)
                continue
            if i in failed:
                # Its KV of this step is not trusted: kv_len stays, so release() caches only the
                # KV of earlier steps and frees the pages this step allocated.
                logger.error("request %s failed in step %d: %s", r.rid, batch.step, failed[i])
                self.finish(r, internal_error(failed[i]))
                continue
            tokens = [next(ids)] if sampled and r.sampling.max_new_tokens > 0 else []
            self._apply_entry(batch, i, r, n, tokens, verdict)
        self.queues.inflight = []

    def _apply_entry(self, batch: BatchResult, i: int, r: Req, n: int, tokens: list[int],
                     verdict: SpecVerdict | None) -> None:
        """Entry i ran r's n tokens (and verified its drafts: verdict); tokens: what it sampled."""
        if batch.readouts:
            collect_readout(r, batch.readouts[i], r.kv_len)
        self.mem.advance(r, n + (verdict.accepted if verdict is not None else 0))  # and the drafts it keeps
        r.slot_initialized = True
        if batch.page_mass and batch.page_mass[i]:
            self.mem.retention.add_mass(r, batch.page_mass[i])
        if verdict is not None:
            self.spec.verified(r, verdict)
            tokens = verdict.kept() + tokens
        try:
            out = self.outputs.after_step(r, batch.logprobs[i] if batch.logprobs else None, tokens)
        except Exception as e:  # a bug met by this request only (stop check, logprobs): fail it alone
            logger.exception("request %s failed after step %d", r.rid, batch.step)
            self.finish(r, internal_error(f"{type(e).__name__}: {e}"))
            return
        if verdict is not None:
            self.mem.keep_to(r, r.seq_len)
        if out is not None:
            self.spec.gained(r, out.new_ids, n == 1 and r.output_len > len(out.new_ids))
            out.spec = r.spec.counts() if r.spec is not None else None
            self.queues.outbox.append(out)
        if r.finish is not None:
            self.spot.on_finish(r)
            self.release(r)
        elif self.long_prompt_threshold and not r.long_rope and r.seq_len > self.long_prompt_threshold:
            self.preemption.recompute_under_long_rope(r)
        elif n > 1:
            self.mem.cache_progress(r)  # a prefill chunk: share its full pages now
