"""SlotTable: the worker's state of each request slot, in one place.

A slot is where the scheduler runs one request (BatchEntry.slot), from the entry that
carries its SlotInit until ForwardBatch.freed_slots names it. Per slot the table holds:

  * its page-table row (page_table[slot, i]: the i-th page of its KV), grown by the
    deltas the scheduler sends and rewritten whole when retention drops pages, and how
    many of its columns are in use (Slot.pages_used);
  * its rope mode (Slot.long_rope: a longrope model's request under the long factors);
  * retention's state (the sink keys of a sink_window request that dropped pages, and the
    mapping of cache indices to positions: retention_tensors.RetentionSlots).

The sampler keeps each slot's sampling state itself (sampler.py).

A slot also holds its request's LoRA adapter slot (Slot.lora, from SlotInit in `apply`):
`lora_rows` gives each batch row's, for the model's LoRA plan (models/lora.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixrt.kernels import PagedKVCache
from radixrt.messages import BatchEntry, ForwardBatch
from radixrt.worker.kv_pool import PAGE_TABLE_DTYPE, page_table_shape
from radixrt.worker.retention_tensors import RetentionSlots


@dataclass
class Slot:
    """One slot's scalar state (its page-table row is page_table[slot])."""

    pages_used: int = 0  # leading columns of its page-table row that hold its pages
    long_rope: bool = False  # a longrope model's request past its original context: the long rope factors
    lora: int = -1  # the LoRA adapter slot its rows add (SlotInit.lora_slot); -1: none


class SlotTable:
    def __init__(self, slots: int, context_length: int, cache: PagedKVCache, model: torch.nn.Module,
                 device: torch.device) -> None:
        self.cache, self.page_size, self.device = cache, cache.page_size, device
        # page_table[slot, i]: the i-th page of the request on that slot; [slots, pages of a context + 1] int64
        self.page_table = torch.zeros(page_table_shape(slots, context_length, self.page_size), dtype=PAGE_TABLE_DTYPE,
                                      device=device)
        self.slots = [Slot() for _ in range(slots)]
        self.retention = RetentionSlots(cache, model, self.page_table)
        # a longrope model's rope: each request runs under its short or long factors, as the scheduler says
        self.longrope = model.rope if model.rope.long_from is not None else None

    def apply(self, batch: ForwardBatch) -> None:
        """Before the batch's forward: freed slots forgotten, new slots started, the copy-on-write
        copies made and the page tables brought up to date (retention's sinks around them)."""
        for slot in batch.freed_slots:
            self.retention.forget(slot)
        self.retention.save_sinks(batch.entries)  # before a copy may overwrite a page a drop freed
        if batch.copy_src:
            src = torch.tensor(batch.copy_src, dtype=torch.int64, device=self.device)
            self.cache.copy_slots(src, torch.tensor(batch.copy_dst, dtype=torch.int64, device=self.device))
        rows, cols, pages = [], [], []
        for e in batch.entries:
            if e.init is not None:
                self.slots[e.slot] = Slot(long_rope=e.init.long_rope, lora=e.init.lora_slot)
            s = self.slots[e.slot]
            if e.retain is not None:  # retention dropped pages: the whole row anew
                self.page_table[e.slot, : len(e.retain.pages)] = torch.tensor(e.retain.pages, dtype=PAGE_TABLE_DTYPE)
                s.pages_used = len(e.retain.pages)
            rows += [e.slot] * len(e.new_pages)
            cols += range(s.pages_used, s.pages_used + len(e.new_pages))
            pages += e.new_pages
            s.pages_used += len(e.new_pages)
        if pages:
            t = lambda x: torch.tensor(x, dtype=torch.int64, device=self.device)  # noqa: E731
            self.page_table[t(rows), t(cols)] = t(pages)
        self.retention.shift_sinks(batch.entries)

    def lora_rows(self, entries: list[BatchEntry]) -> list[int]:
        """Each input row's LoRA adapter slot (-1: the base model), in batch order."""
        return [self.slots[e.slot].lora for e in entries for _ in range(len(e.input_ids))]

    def rows(self, slots: torch.Tensor, max_pages: int) -> torch.Tensor:
        """slots: [B] -> [B, max_pages] their page tables' first columns."""
        return self.page_table[slots, :max_pages]

    def cache_slots(self, slots: list[int], index: list[int]) -> torch.Tensor:
        """[n] int64 the cache slots of cache index index[i] of the request on slots[i]."""
        s, idx = (torch.tensor(x, dtype=torch.int64, device=self.device) for x in (slots, index))
        return self.page_table[s, idx // self.page_size].to(torch.int64) * self.page_size + idx % self.page_size

    def positions(self, entries: list[BatchEntry], index: torch.Tensor, req_of_row: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """index: [T] cache indices -> ([T] the rows of the rope tables the model reads, grew): a
        token's place in its sequence (retention may have dropped tokens before it), under its
        slot's rope mode. grew: the rope tables were reallocated (recapture CUDA graphs)."""
        positions, grew = self.retention.positions(entries, index, req_of_row)
        if self.longrope is not None:  # short or long factors per request
            long = torch.tensor([self.slots[e.slot].long_rope for e in entries], dtype=torch.bool, device=index.device)
            positions = self.longrope.table_rows(positions, long[req_of_row])
        return positions, grew
