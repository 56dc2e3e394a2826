"""Phi-3: the shared decoder, loaded from a checkpoint whose q/k/v and gate/up are already fused.

The checkpoint's `qkv_proj` ([q rows; k rows; v rows]) and `gate_up_proj` ([gate rows;
up rows]) are presented to the shared loader as their parts (q_proj, k_proj, ...), each a
lazy row block, so that a tensor-parallel rank reads only its own heads and features.
LongRoPE (rope.py) and the sliding window (attention_layers) come from ModelConfig.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator

from radixrt.models.llama import LlamaForCausalLM


@dataclass(frozen=True)
class RowBlock:
    """Rows [start, start + count) of a checkpoint tensor, indexed like a tensor of its own."""

    source: Any  # a tensor or a safetensors slice
    start: int
    count: int

    def __getitem__(self, index: tuple[slice, ...]) -> Any:
        rows, *rest = index
        lo, hi, step = rows.indices(self.count)
        assert step == 1, "row blocks are read in contiguous slices"
        return self.source[(slice(self.start + lo, self.start + hi), *rest)]


class Phi3ForCausalLM(LlamaForCausalLM):
    def checkpoint_tensors(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        cfg = self.cfg
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        parts = {  # fused checkpoint tensor -> (part, first row, rows) in its row order
            "qkv_proj": [("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv)],
            "gate_up_proj": [("gate_proj", 0, cfg.intermediate_size), ("up_proj", cfg.intermediate_size, cfg.intermediate_size)],
        }
        for name, source in super().checkpoint_tensors(weights):
            fused = next((f for f in parts if name.endswith(f".{f}.weight")), None)
            if fused is None:
                yield name, source
                continue
            for part, start, count in parts[fused]:
                yield name.replace(fused, part), RowBlock(source, start, count)
