"""SinkKeys: the attention sinks' keys of sink_window requests, kept as first computed.

When a request under sink_window drops D tokens after its sinks, the sinks' keys
must sit D positions later (so that each query sees them at StreamingLLM's in-cache
distance; radixrt/scheduler/retention.py). Rotating the stored keys again and again
would add a rounding per drop (bf16 and quantized pools lose bits each time), so
the worker keeps each slot's sink keys as first computed (what the pool returns:
dequantized, in the model's dtype) and writes rope(D) of those at every drop. The
copy is per slot, every layer, K only: sink_tokens x layers x kv_heads x head_dim,
outside the pool, freed with the slot.
"""

from __future__ import annotations

import torch

from radixrt.kernels import PagedKVCache
from radixrt.models.rope import RotaryEmbedding


class SinkKeys:
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
