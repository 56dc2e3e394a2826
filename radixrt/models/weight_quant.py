"""Putting a model's linear layers into int8: before a pre-quantized checkpoint loads, after an
unquantized one has, and the kernel every int8 layer multiplies through.

Which layers: every ColumnParallelLinear and RowParallelLinear (attention's qkv and o, the dense
MLP's gate_up and down) but the LM head, which SGLang and llm-compressor also leave in the
model's dtype (its logits decide every token; on a small model it is a large share of the
weights, and tied to the embedding). MoE experts keep the model's dtype: load_for_serving logs it.

Fused layers quantize per output row, so a fused qkv's rows carry the scales the separate q, k
and v tensors had; a row-parallel layer's rows are split over ranks by their input features, so
quantizing at load takes each row's amax over all ranks (one all-reduce) and every rank holds
the same int8 values as one rank would.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from radixrt.models.int8_linear import Int8Choice, kernel_for, quantize_rows
from radixrt.models.parallel import ColumnParallelLinear, RowParallelLinear, TPGroup

logger = logging.getLogger(__name__)


def int8_targets(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """The (name, module) pairs of the linear layers an int8 scheme quantizes."""
    for name, module in model.named_modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and not name.endswith("lm_head"):
            yield name, module


def is_int8(module: nn.Module) -> bool:
    return module.weight.dtype == torch.int8


def _hold(module: nn.Module, q: torch.Tensor, scale: torch.Tensor) -> None:
    module.weight = nn.Parameter(q, requires_grad=False)
    module.weight_scale = nn.Parameter(scale, requires_grad=False)


def hold_int8_placeholders(model: nn.Module) -> None:
    """Give each target int8 `weight` and float32 `weight_scale` parameters of its shard's shape,
    for a pre-quantized checkpoint's tensors to load into (exactly: int8 into int8)."""
    for _, module in int8_targets(model):
        out = module.weight.shape[0]
        device = module.weight.device
        _hold(module, torch.empty_like(module.weight, dtype=torch.int8),
              torch.empty(out, 1, dtype=torch.float32, device=device))


def quantize_linear_weights(model: nn.Module, tp: TPGroup) -> None:
    """Quantize each target's loaded weight in place (symmetric int8 per output row)."""
    for _, module in int8_targets(model):
        w = module.weight.detach().float()
        amax = w.abs().amax(dim=1, keepdim=True)
        if isinstance(module, RowParallelLinear) and tp.size > 1:
            torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX)
        _hold(module, *quantize_rows(w, amax))


def without_zero_points(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """A pre-quantized checkpoint's tensors less its `weight_zero_point`s, which a symmetric scheme
    may store as zeros; a nonzero one (an asymmetric scheme) raises ValueError."""
    for name, source in weights:
        if name.endswith(".weight_zero_point"):
            if torch.count_nonzero(source[:] if not isinstance(source, torch.Tensor) else source):
                raise ValueError(f"checkpoint tensor {name} is nonzero: an asymmetric int8 scheme, which radixrt "
                                 "does not run (it runs symmetric per-channel int8)")
            continue
        yield name, source


def use_int8_kernel(model: nn.Module, choice: Int8Choice) -> int:
    """Make every int8 layer multiply through the chosen kernel; returns how many layers."""
    count = 0
    for _, module in int8_targets(model):
        module.int8 = kernel_for(choice, module.weight, module.weight_scale)
        count += 1
    return count
