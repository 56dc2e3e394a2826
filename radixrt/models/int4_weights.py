"""`--torchao-config int4wo-<group>` (SGLang's name for torchao's int4 weight-only): an unquantized
checkpoint's linear layers quantized at load to 4 bits per group of `group` along the input, asymmetric
(scale (max - min) / 15 and the group's min, element = scale * q + min, q in 0..15, as torchao's
int4_weight_only with its float zero point), and held in the GGUF path's 4-bit tiles (gguf_weights.py,
kernels/quant_weights.py): the same kernels, activations rounded to int8 per 32 for the integer
products, or the weight dequantized per call where start-up measured that faster.

As SGLang's torchao filter, only the layers named *proj (attention and MLP projections) are quantized;
the embedding and LM head stay in the model's dtype, as does a layer the tiles cannot take (out_features
not a multiple of 16, in_features not of 32; a shorter last group where it is not a multiple of the group).
Under tensor parallelism each rank quantizes the slice it loaded (as torchao does a sharded weight): a
row-parallel layer's groups start at its slice's first input. CPU only: elsewhere refused by name.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from radixrt.kernels.quant_weights import GROUP, load_qgemm
from radixrt.models.weight_quant import int8_targets

logger = logging.getLogger(__name__)

GROUPS = (32, 64, 128, 256)  # torchao's int4 group sizes


def quantize_int4(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] (K a multiple of 32) -> (values uint8 0..15 [N, K], scales, mins float16 [N, K / 32]): per
    group of `group` along K one scale and min (float16, what the tiles hold), repeated over its groups of 32.
    Where K is not a multiple of the group (SmolLM2's 576 at 128) the last group is shorter, not refused."""
    N, K = weight.shape
    blocks, per = weight.float().view(N, K // GROUP, GROUP), group // GROUP
    lo, hi = blocks.amin(-1), blocks.amax(-1)  # [N, K / 32]
    pad = -(K // GROUP) % per

    def grouped(t: torch.Tensor, fill: float, reduce: str) -> torch.Tensor:
        t = torch.cat([t, t.new_full((N, pad), fill)], dim=1).view(N, -1, per)
        return getattr(t, reduce)(-1).repeat_interleave(per, dim=1)[:, : K // GROUP]

    lo, hi = grouped(lo, float("inf"), "amin"), grouped(hi, float("-inf"), "amax")
    scales = ((hi - lo) / 15).clamp(min=2**-14).half()  # float16's smallest normal: no zero or subnormal scales
    mins = lo.half()
    q = (blocks - mins.float()[..., None]) / scales.float()[..., None]
    return q.round().clamp(0, 15).to(torch.uint8).view(N, K), scales, mins


def quantize_layers(model: nn.Module, group: int, device: torch.device) -> dict[str, str]:
    """Quantize each *proj layer's loaded weight (this rank's slice) in place into the placeholders
    gguf_weights.pack_layers packs (`weight` values, `weight_scale`, `weight_min`); returns them (name -> "q4")."""
    why = "not on the CPU" if device.type != "cpu" else "without the compiled quantized GEMM" if load_qgemm() is None else ""
    if why:
        raise ValueError(f"--torchao-config int4wo-{group} holds the weights in radixrt's 4-bit CPU tiles; "
                         f"this server runs {why} (use int8wo, or serve unquantized)")
    layers, kept = {}, []
    for name, module in int8_targets(model):
        out, inp = module.weight.shape
        if out % 16 or inp % GROUP:
            kept.append(name)
            continue
        values, scales, mins = quantize_int4(module.weight.data, group)
        module.weight = nn.Parameter(values, requires_grad=False)
        module.weight_scale = nn.Parameter(scales, requires_grad=False)
        module.weight_min = nn.Parameter(mins, requires_grad=False)
        layers[name] = "q4"
    if kept:
        logger.info("int4wo-%d: %d layers the tiles cannot take stay in the model's dtype: %s", group, len(kept), ", ".join(kept))
    return layers
