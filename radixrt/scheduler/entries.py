"""EntryBuilder: a request's entry in the step's batch, once the scheduler chose how many tokens it
runs. Its pages grow by those tokens and the drafts it verifies (a retention policy may drop some
first); the worker's slot for it is initialized the first time it runs; and the entry carries what
the worker needs for the step: tokens and drafts, the logprobs it asks for, the tokens its grammar
allows, its readout (readouts.py). Each entry built joins the batch in flight, in order."""

from __future__ import annotations

from radixrt.messages import BatchEntry, SlotInit
from radixrt.retention.counters import RetentionCounters
from radixrt.scheduler.kv_memory import KVMemory
from radixrt.scheduler.logprobs import logprob_spec
from radixrt.scheduler.queues import Queues
from radixrt.scheduler.readouts import chunk_readout
from radixrt.scheduler.req import Req
from radixrt.scheduler.speculation import Draft, Speculator
from radixrt.scheduler.stop import StopChecker


class EntryBuilder:
    def __init__(self, queues: Queues, mem: KVMemory, spec: Speculator, retention: RetentionCounters,
                 stop: StopChecker) -> None:
        self.queues, self.mem, self.spec, self.retention, self.stop = queues, mem, spec, retention, stop

    def entry(self, r: Req, n: int, draft: Draft | None = None) -> BatchEntry:
        """r runs its next n tokens (and verifies `draft`, when it has one) in this step."""
        draft = draft or Draft([])
        start, dropped = r.kv_len, r.kv.dropped
        retain = self.mem.retention.retain(r, n) if r.retention is not None else None
        new_pages = self.mem.grow(r, n + draft.length)
        self.spec.wrote(r, r.kv.pages[r.kv.kv_len // self.mem.page_size :], draft)
        self.retention.after_growth(r, (r.kv.dropped - dropped) // self.mem.page_size)
        sample = start + n == r.seq_len and r.sampling.max_new_tokens > 0
        init = None if r.slot_initialized else self._slot_init(r)
        self.queues.inflight.append((r, n))
        allowed = r.grammar.allowed() if sample and r.grammar is not None else b""
        return BatchEntry(slot=r.slot, input_ids=r.tokens(start, start + n) + draft.tokens, start_pos=r.kv.kv_len,
                          new_pages=new_pages, sample=sample, init=init, logprobs=logprob_spec(r, start, n),
                          allowed=allowed, pos_offset=r.kv.dropped, retain=retain,
                          want_mass=r.retention is not None and r.retention.wants_mass, draft_len=len(draft.tokens),
                          propose=draft.propose, draft_parents=draft.parents, readout=chunk_readout(r, start, n))

    def _slot_init(self, r: Req) -> SlotInit:
        """What the worker's slot for r holds until r leaves: its sampling, stop ids, penalties' ids,
        LoRA adapter slot and rope factors."""
        penalty_ids = r.prompt_ids if r.sampling.repetition_penalty != 1 else []
        return SlotInit(r.sampling, self.stop.stop_ids(r), penalty_ids, list(r.output_ids), r.long_rope, r.lora_slot)
