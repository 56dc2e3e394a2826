"""A tensor-free stand-in for the worker that keeps real page contents.

It stores every token written at its slot, and its "model" predicts the next
token from what the request's page table actually shows. So if the scheduler
gets any page, position or retraction wrong, the tokens come out different
from `reference_next` applied to the true sequence.
"""

from __future__ import annotations

from radixrt.messages import BatchResult, EntryLogprobs, ForwardBatch, WorkerReady

VOCAB = 50


def reference_next(seq: list[int]) -> int:
    return (sum((i + 1) * t for i, t in enumerate(seq[-8:])) + len(seq)) % VOCAB


def reference_generate(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(reference_next(seq))
    return seq[len(prompt):]


class FakeWorker:
    def __init__(self, num_pages: int, page_size: int, context_length: int = 4096, eos_ids=(49,)) -> None:
        self.ready = WorkerReady(num_pages, page_size, VOCAB, context_length, list(eos_ids), 8)
        self.page_size = page_size
        self.slots: dict[int, int] = {}  # slot -> token at that KV slot
        self.tables: dict[int, list[int]] = {}  # request slot -> page table

    def forward(self, batch: ForwardBatch) -> BatchResult:
        for s in batch.freed_slots:
            self.tables.pop(s, None)
        for src, dst in zip(batch.copy_src, batch.copy_dst):
            self.slots[dst] = self.slots[src]
        next_ids, logprobs = [], []
        for e in batch.entries:
            if e.init is not None:
                self.tables[e.slot] = []
            table = self.tables[e.slot]
            table += e.new_pages
            for i, tok in enumerate(e.input_ids):
                pos = e.start_pos + i
                self.slots[table[pos // self.page_size] * self.page_size + pos % self.page_size] = tok
            if e.sample:
                end = e.start_pos + len(e.input_ids)
                seq = [self.slots[table[p // self.page_size] * self.page_size + p % self.page_size] for p in range(end)]
                next_ids.append(reference_next(seq))
            logprobs.append(EntryLogprobs(output=-1.0) if e.logprobs is not None else None)
        return BatchResult(batch.step, next_ids, logprobs if any(logprobs) else [])
