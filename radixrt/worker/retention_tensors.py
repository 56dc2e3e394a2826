"""Bounded-KV retention, the worker's half (radixrt/retention/ is the scheduler's): slots whose
pages were dropped, their sinks' keys, positions past the rope tables, and the attention mass
heavy_hitter's scheduler reads.

Before a step (SlotTable.apply): the sink keys of a first drop are saved before any copy can
overwrite their pages, and after the page tables are rewritten the sinks are re-rotated
(SinkKeys). During it: a token runs at its cache index plus its entry's pos_offset (its place
in the sequence), which may pass the rope tables (rope.py's scratch rows). After it: the
backend's per-page attention mass, summed over the tensor-parallel ranks' heads.
"""

from __future__ import annotations

import math

import torch

from radixrt.kernels import AttentionBackend, PagedKVCache
from radixrt.messages import BatchEntry
from radixrt.models.parallel import TPGroup
from radixrt.models.rope import RotaryEmbedding
from radixrt.retention.policies import POLICIES

LONGROPE_REFUSAL = "a longrope model's rope factors change with the sequence length, so kept keys cannot be re-positioned"


def refusals(model: torch.nn.Module, attn: AttentionBackend, server_policy: str) -> dict[str, str]:
    """Why this worker cannot run each bounded retention policy, by name (absent: it can).
    ValueError naming --kv-retention when it cannot run the server's own policy."""
    out: dict[str, str] = {}
    for policy, budget in POLICIES.items():
        if model.rope.long_from is not None:
            out[policy.value] = LONGROPE_REFUSAL
        elif budget.wants_mass and not attn.reports_attention_mass:
            out[policy.value] = (f"the {type(attn).__name__} attention backend does not report per-page attention "
                                 "mass; use --attention-backend torch")
    if server_policy in out:
        raise ValueError(f"kv_retention {server_policy}: {out[server_policy]}")
    return out


class SinkKeys:
    """The attention sinks' keys of sink_window requests, kept as first computed.

    When a request under sink_window drops D tokens after its sinks, the sinks' keys must sit
    D positions later (so that each query sees them at StreamingLLM's in-cache distance;
    radixrt/retention/policies.py). Rotating the stored keys again and again would add a
    rounding per drop (bf16 and quantized pools lose bits each time), so the worker keeps each
    slot's sink keys as first computed (what the pool returns: dequantized, in the model's
    dtype) and writes rope(D) of those at every drop. The copy is per slot, every layer, K only:
    sink_tokens x layers x kv_heads x head_dim, outside the pool, freed with the slot."""

    def __init__(self, cache: PagedKVCache, layer_ropes: list[RotaryEmbedding]) -> None:
        self.cache = cache
        self.layer_ropes = layer_ropes  # one per layer (Gemma 3's sliding layers have their own)
        self.saved: dict[int, list[torch.Tensor]] = {}  # slot -> per layer [sink_tokens, kv_heads, head_dim]

    def forget(self, slot: int) -> None:
        self.saved.pop(slot, None)

    def save(self, slot: int, slots: torch.Tensor) -> None:
        """Keep the keys now at cache slots [sink_tokens] as the slot's sinks."""
        self.saved[slot] = [self.cache.read_keys(layer, slots).clone() for layer in range(len(self.cache.k))]

    def shift(self, slot: int, slots: torch.Tensor, delta: int) -> None:
        """Write the slot's sink keys, rotated `delta` positions on, at cache slots [sink_tokens]."""
        saved = self.saved[slot]
        for layer, (k, rope) in enumerate(zip(saved, self.layer_ropes)):
            self.cache.write_keys(layer, slots, rope.shift_keys(k, delta))


class RetentionSlots:
    """Retention's per-slot state (the sinks' keys) and its position mapping, over SlotTable's page table."""

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
