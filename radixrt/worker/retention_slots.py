"""The worker's side of bounded-KV retention: slots whose pages were dropped, positions
past the rope tables, and the attention mass heavy_hitter's scheduler reads.

Before a step (ModelRunner._apply_slot_changes): the sink keys of a first drop are
saved before any copy can overwrite their pages, and after the page tables are
rewritten the sinks are re-rotated (sink_keys.py). During it: a token runs at its
cache index plus its entry's pos_offset (its place in the sequence), which may pass
the rope tables (rope.py's scratch rows). After it: the backend's per-page attention
mass, summed over the tensor-parallel ranks' heads.
"""

from __future__ import annotations

import math

import torch

from radixrt.kernels import AttentionBackend, PagedKVCache
from radixrt.messages import BatchEntry
from radixrt.models.parallel import TPGroup
from radixrt.worker.sink_keys import SinkKeys


def refusals(model: torch.nn.Module, attn: AttentionBackend) -> dict[str, str]:
    """Why this worker cannot run each retention policy (absent: it can)."""
    out: dict[str, str] = {}
    if model.rope.long_from is not None:
        why = "a longrope model's rope factors change with the sequence length, so kept keys cannot be re-positioned"
        out = {"sink_window": why, "heavy_hitter": why}
    elif not attn.reports_attention_mass:
        out["heavy_hitter"] = (f"the {type(attn).__name__} attention backend does not report per-page attention "
                               "mass; use --attention-backend torch")
    return out


class RetentionSlots:
    def __init__(self, cache: PagedKVCache, model: torch.nn.Module, page_table: torch.Tensor) -> None:
        self.cache, self.page_table, self.page_size = cache, page_table, cache.page_size
        self.sinks = SinkKeys(cache, model.layer_ropes)
        self.ropes = list({id(r): r for r in model.layer_ropes}.values())  # the distinct embeddings
        self.max_positions = model.rope.max_positions

    def _slots(self, slot: int, n: int) -> torch.Tensor:
        """Cache slots of the first n tokens in slot's page table."""
        ps = self.page_size
        pages = self.page_table[slot, : math.ceil(n / ps)]
        return (pages[:, None] * ps + torch.arange(ps, device=pages.device)).reshape(-1)[:n]

    def save_sinks(self, entries: list[BatchEntry]) -> None:
        """First drops: keep the sinks' keys (from the page tables as they are) before anything moves."""
        for e in entries:
            if e.retain is not None and e.retain.save_sinks:
                self.sinks.save(e.slot, self._slots(e.slot, e.retain.sink_tokens))

    def shift_sinks(self, entries: list[BatchEntry]) -> None:
        """After the page tables are rewritten: the sinks' keys rotated by the tokens dropped after them."""
        for e in entries:
            if e.retain is not None and e.retain.sink_tokens:
                self.sinks.shift(e.slot, self._slots(e.slot, e.retain.sink_tokens), e.retain.sink_shift)

    def forget(self, slot: int) -> None:
        self.sinks.forget(slot)

    def positions(self, entries: list[BatchEntry], index: torch.Tensor, req_of_row: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """index: [T] cache indices -> ([T] rows of the rope tables: index + the entry's pos_offset, grew):
        grew means the tables were reallocated for positions past them (recapture CUDA graphs)."""
        if not any(e.pos_offset for e in entries):
            return index, False
        offsets = torch.tensor([e.pos_offset for e in entries], dtype=torch.int64, device=index.device)
        positions = index + offsets[req_of_row]
        if max(e.start_pos + e.pos_offset + len(e.input_ids) for e in entries) <= self.max_positions:
            return positions, False
        rows, grew = None, False
        for rope in self.ropes:  # every table has the same length, so the same far positions get the same rows
            rows, g = rope.rows_for(positions)
            grew |= g
        return rows, grew


def gather_mass(attn: AttentionBackend, entries: list[BatchEntry], mass_reqs: list[int], tp: TPGroup) -> list[list[float]]:
    """Per entry the attention mass of each of its pages ([] unless it asked), summed over every rank's heads."""
    if not mass_reqs:
        return []
    parts = attn.take_page_mass()  # per mass request [pages] float32
    flat = torch.cat(parts)
    if tp.size > 1:
        torch.distributed.all_reduce(flat)
    out: list[list[float]] = [[] for _ in entries]
    for i, m in zip(mass_reqs, flat.split([len(p) for p in parts])):
        out[i] = m.tolist()
    return out
