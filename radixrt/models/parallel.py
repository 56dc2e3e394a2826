"""Tensor parallelism for the model: the rank's group, and the layers that split across it.

Column-parallel layers are nn.Linear with this rank's output rows;
row-parallel layers all-reduce their partial sums before adding the bias once.
Both compute in their weight's dtype and return their input's dtype: weights
held in float32 for a half-precision model (cpu_matmul.py) change where the
arithmetic runs, not what the layers pass on. On CPU a layer may also hold its
weight packed once for oneDNN (`packed`, cpu_matmul.pack_linear_weights); it then
multiplies through that copy, the same product in another kernel. A quantized layer holds int8
weights and their scales and multiplies through its int8 kernel (weight_quant.py).
A layer may carry LoRA slots (`lora`, models/lora.py) whose delta it adds to its output.
The vocabulary splits in contiguous blocks for the embedding and the LM head.
With size 1 every collective is skipped, so one code path serves both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from radixrt.models.config import ModelConfig


class LinearDelta(Protocol):
    """What a linear layer adds to its own output (a LoRA site, models/lora.py, registers itself
    on the layers from outside): add(x, y) adds its delta for inputs x to y in place."""

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None: ...


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1

    def split(self, n: int, what: str) -> tuple[int, int]:
        """This rank's [start, start + count) of n items divided evenly."""
        if n % self.size:
            raise ValueError(f"{what} ({n}) is not divisible by tp_size {self.size}")
        count = n // self.size
        return self.rank * count, count

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            torch.distributed.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank -> [..., n * size], rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        torch.distributed.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


# What a layer loads beside `weight` when its checkpoint holds it quantized: an int8 or fp8 scale per output
# channel, or a GGUF layer's scale and min per group of inputs (gguf_weights.py)
HELD_PARTS = ("weight_scale", "weight_min")


def rank_heads(cfg: ModelConfig, tp: TPGroup) -> tuple[int, int, int, int]:
    """(first q head, q heads, first kv head, kv heads) of this rank; KV heads are
    replicated when there are fewer of them than ranks."""
    q_start, q_count = tp.split(cfg.num_heads, "num_attention_heads")
    if cfg.num_kv_heads >= tp.size:
        kv_start, kv_count = tp.split(cfg.num_kv_heads, "num_key_value_heads")
    else:
        kv_start, kv_count = tp.rank * cfg.num_kv_heads // tp.size, 1
    return q_start, q_count, kv_start, kv_count


def _linear(weight: torch.Tensor, packed: torch.Tensor | None, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight^T (+ bias) in the weight's dtype, through the packed copy when there is one."""
    x = x.to(weight.dtype)
    if packed is None:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _product(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The layer's x @ W^T (+ bias) in its compute dtype, its LoRA deltas added to that in place
    (no pass over the output of their own), returned in x's dtype."""
    if layer.quant is not None:  # held as a GGUF file's blocks (gguf_weights.py)
        xw, y = x, layer.quant(x)
        y = y if bias is None else y + bias
    elif layer.int8 is not None:
        xw, y = x, layer.int8(x, layer.weight, layer.weight_scale, bias)
    else:
        xw = x.to(layer.weight.dtype)  # once, for the base product and the adapters' alike
        y = _linear(layer.weight, layer.packed, xw, bias)
    if layer.lora is not None:
        layer.lora.add(xw.to(y.dtype), y)
    return y.to(x.dtype)


class ColumnParallelLinear(nn.Linear):
    """y = x @ W_shard^T + b_shard: this rank's output features (nn.Linear's parameters)."""

    packed: torch.Tensor | None = None  # the weight as oneDNN holds it (cpu_matmul.pack_linear_weights)
    # An int8 layer (weight_quant.py): weight is int8 [out, in], weight_scale float32 [out, 1], and
    # int8 the kernel that multiplies them (int8_linear.Int8Kernel).
    int8: Callable | None = None
    quant: Callable | None = None  # a layer held as a GGUF file's blocks: its product (gguf_weights.QuantLinear)
    lora: LinearDelta | None = None  # its LoRA adapters' slots (models/lora.py), under --enable-lora

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _product(self, x, self.bias)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_shard @ W_shard^T) + b: the input features are split across ranks."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, in_features))  # [out, in / tp]
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.packed: torch.Tensor | None = None  # as ColumnParallelLinear.packed
        self.int8: Callable | None = None  # as ColumnParallelLinear.int8
        self.quant: Callable | None = None  # as ColumnParallelLinear.quant
        self.lora: LinearDelta | None = None  # as ColumnParallelLinear.lora: its delta joins the partial sums

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(_product(self, x, None))
        return y + self.bias.to(y.dtype) if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a contiguous block of the vocabulary's rows; lookups sum across ranks."""

    def __init__(self, vocab: int, hidden: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.start, self.count = tp.split(vocab, "vocab_size")
        self.weight = nn.Parameter(torch.empty(self.count, hidden))  # [vocab / tp, hidden]
        self.quant: Callable | None = None  # rows from a tied LM head held as a GGUF file's blocks (gguf_weights.QuantRows)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.quant(ids) if self.quant is not None else F.embedding(ids, self.weight)
        local = ids - self.start
        inside = (local >= 0) & (local < self.count)
        local = local.clamp(0, self.count - 1)
        x = (self.quant(local) if self.quant is not None else F.embedding(local, self.weight)) * inside[:, None]
        return self.tp.all_reduce(x)
