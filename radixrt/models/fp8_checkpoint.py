"""fp8 checkpoints (quantization_config quant_method "fp8"), dequantized at load.

Such a checkpoint holds each linear layer's `weight` in float8_e4m3fn with a float32 scale:
`weight_scale` (one per tensor, or one per output row) multiplies it, or `weight_scale_inv`
(DeepSeek's block-wise layout: one per [bh, bw] block, weight_block_size in the config)
does. `input_scale` tensors, where present, are the activations' static scales: radixrt runs
activations unquantized, so it drops them. The weights are dequantized to the serving dtype
as their tensors arrive, so the model loads them as an unquantized checkpoint's. On CPU there
is no fp8 GEMM; on CUDA this is also what radixrt does (torch's fp8 GEMM is not wired in), so
an fp8 checkpoint serves at its dequantized precision and memory. Untested on CUDA here.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale")


def dequantize_fp8(weights: Iterable[tuple[str, Any]], dtype: torch.dtype) -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors with each fp8 weight replaced by weight * scale in dtype (its scale
    tensor consumed) and input scales dropped; other tensors pass through. Raises ValueError for
    an fp8 weight without a scale, or a scale without its weight."""
    held: dict[str, torch.Tensor] = {}  # fp8 weights or scales waiting for their partner, by layer prefix
    for name, source in weights:
        if name.endswith(".input_scale"):
            continue
        prefix, part = _split(name, source)
        if part is None:
            yield name, source
            continue
        tensor = source[:] if not isinstance(source, torch.Tensor) else source
        partner = held.pop(prefix, None)
        if partner is None:
            held[prefix] = tensor
            continue
        weight, scale = (tensor, partner) if part == "weight" else (partner, tensor)
        yield f"{prefix}.weight", _dequantize(weight, scale).to(dtype)
    if held:
        raise ValueError(f"fp8 checkpoint: {sorted(held)[:3]} lack their weight or its scale")


def _split(name: str, source: Any) -> tuple[str, str | None]:
    """(layer prefix, "weight" | "scale") for an fp8 weight's tensors, else (name, None)."""
    for suffix in SCALE_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)], "scale"
    if name.endswith(".weight") and _is_fp8(source):
        return name.removesuffix(".weight"), "weight"
    return name, None


def _is_fp8(source: Any) -> bool:
    """A tensor, or a safetensors slice (whose get_dtype() names the stored type), of fp8."""
    if isinstance(source, torch.Tensor):
        return source.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    return source.get_dtype().startswith("F8")


def _dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """weight [out, in] fp8 times its scale: a scalar, a row [out, 1], or blocks [ceil(out/bh), ceil(in/bw)]."""
    w = weight.float()
    s = scale.float()
    if s.numel() == 1 or s.shape == (w.shape[0], 1) or s.shape == (w.shape[0],):
        return w * s.reshape(-1, 1) if s.numel() > 1 else w * s.reshape(())
    bh, bw = -(-w.shape[0] // s.shape[0]), -(-w.shape[1] // s.shape[1])
    full = s.repeat_interleave(bh, dim=0)[: w.shape[0]].repeat_interleave(bw, dim=1)[:, : w.shape[1]]
    return w * full
