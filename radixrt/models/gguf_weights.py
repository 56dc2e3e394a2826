"""A GGUF file's linear weights held as the file quantizes them, on the CPU (issue: GGUF weights that stay
quantized): Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q6_K and Q8_0 tensors load as their blocks' values, scales and
mins (gguf_blocks.py) and multiply through the compiled quantized GEMM (kernels/quant_weights.py) instead
of being dequantized to the model's dtype.

A linear layer is held so when every GGUF tensor that fills it (q, k and v for a fused qkv; gate and up)
is one of those types, in the smallest format all of them fit exactly (gguf_blocks.layer_format: Q5_0 q
and k beside a Q8_0 v make an int8 qkv); so is an untied LM head (llama.cpp's output.weight),
and a tied embedding (token_embd.weight) serves as both: the head multiplies through it and the
embedding's rows are dequantized from it per lookup (QuantRows), one copy as in the file. Any other
tensor loads dequantized as before. The layer's placeholders take the checkpoint's rows exactly as float weights do,
through the model's own load_weights (`weight` values, `weight_scale`, `weight_min`), so fused layers and
transformers' row permutations apply unchanged; after loading each is packed into the kernel's layout.
Held where the CPU kernel builds, on every tensor-parallel rank (RADIXRT_GGUF_WEIGHTS=dequantize turns it off).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections import defaultdict

import torch
from torch import nn

from radixrt.kernels.huge_pages import Arena
from radixrt.kernels.quant_weights import FORMATS, Format, load_qgemm, pack, tile_kernels
from radixrt.models.gguf_blocks import layer_format
from radixrt.models.parallel import HELD_PARTS
from radixrt.models.quant_linear import QuantLinear, QuantRows, choose_routes
from radixrt.models.weight_quant import int8_targets

logger = logging.getLogger(__name__)

MODE_ENV = "RADIXRT_GGUF_WEIGHTS"  # "quantized" (the default where it serves) or "dequantize"
TIED = "embed_tokens"  # a tied embedding held: the LM head's weight too


def resident_layers(model: nn.Module, tensor_types: dict[str, str], device: torch.device) -> dict[str, str]:
    """The linear layers to hold quantized (module name -> format name), from the GGUF tensors' types by the
    Hugging Face parameter they fill; {} (logged) where none can be. Under tensor parallelism each rank holds
    its own slice (rows, or for a row-parallel layer groups of 32 inputs: the model's shard plan), where the
    kernel tiles it."""
    mode = os.environ.get(MODE_ENV, "quantized").strip().lower()
    if mode not in ("quantized", "dequantize"):
        raise ValueError(f"{MODE_ENV}={mode!r}: choose quantized or dequantize")
    why = ("asked to dequantize" if mode == "dequantize" else "not on the CPU" if device.type != "cpu"
           else "this model's loader has no shard plan" if not hasattr(model, "_shard_plan")
           else "the compiled GEMM is unavailable" if load_qgemm() is None else "")
    if why:
        logger.info("GGUF weights: dequantized to the model's dtype at load (%s)", why)
        return {}
    types_of: dict[str, set[str]] = defaultdict(set)
    for hf_name, qtype in tensor_types.items():
        target, _, _ = model._shard_plan(hf_name.removeprefix("model."))
        types_of[target.removesuffix(".weight")].add(qtype)
    tied = getattr(model.cfg, "tie_word_embeddings", False)
    names = [name for name, _ in int8_targets(model)] + [TIED if tied else "lm_head"]
    layers = {name: layer_format(types_of.get(name, set())) for name in names}
    return {name: fmt for name, fmt in layers.items() if fmt is not None and _tiles(model.get_submodule(name))}


def _packed_bytes(module: nn.Module, fmt: Format) -> list[int]:
    """The bytes of the tensors `pack` makes of a held layer in fmt: its values, float16 scales and mins."""
    out, inp = module.weight.shape
    return [out * inp * fmt.bits // 8, out * inp // fmt.sub * 2] + ([out * inp // 32 * 2] if fmt.has_min else [])


def _tiles(module: nn.Module) -> bool:
    """Whether the kernel tiles the layer: out_features a multiple of 16, in_features of 32."""
    out, inp = module.weight.shape
    return out % 16 == 0 and inp % 32 == 0


def hold_placeholders(model: nn.Module, layers: dict[str, str]) -> None:
    """Give each held layer a `weight` of its values (uint8 for 4 and 5 bits, int8 for 8), float16
    `weight_scale` [out, in / sub] and, for 4 and 5 bits, `weight_min` [out, in / 32], for the checkpoint's
    rows to load into."""
    for name, fmt_name in layers.items():
        module, fmt = model.get_submodule(name), FORMATS[fmt_name]
        out, inp = module.weight.shape
        module.weight = nn.Parameter(torch.empty(out, inp, dtype=torch.int8 if fmt.bits == 8 else torch.uint8), requires_grad=False)
        module.weight_scale = nn.Parameter(torch.empty(out, inp // fmt.sub, dtype=torch.float16), requires_grad=False)
        if fmt.has_min:
            module.weight_min = nn.Parameter(torch.empty(out, inp // 32, dtype=torch.float16), requires_grad=False)


def pack_layers(model: nn.Module, layers: dict[str, str], dtype: torch.dtype) -> int:
    """Pack each held layer's loaded values into the kernel's layout, in huge pages, and multiply through it (the
    placeholders dropped: `weight` stays an empty [0, in] tensor of the model's dtype); a tied embedding's
    becomes the LM head's product and the embedding's lookup. Returns the bytes held."""
    kernel, others, held, routes = load_qgemm(), tile_kernels(), 0, {}
    arena = Arena([n for name, f in layers.items() for n in _packed_bytes(model.get_submodule(name), FORMATS[f])])
    for name, fmt_name in layers.items():
        module = model.get_submodule(name)
        w = pack(module.weight.data, module.weight_scale.data, getattr(module, "weight_min", None), FORMATS[fmt_name])
        weight = dataclasses.replace(w, packed=arena.take(w.packed), scales=arena.take(w.scales),
                                     mins=arena.take(w.mins) if w.mins is not None else None)
        if fmt_name not in routes and dtype in (torch.float32, torch.bfloat16):  # measured on the first layer of each
            routes[fmt_name], timings = choose_routes(weight, kernel, others, dtype)
            logger.info("GGUF weights, %s: %s (%s)", fmt_name, ", ".join(str(r) for r in routes[fmt_name]) or
                        f"the {kernel.isa.name} tiles at every row count", timings)
        product = QuantLinear(weight, kernel, routes.get(fmt_name, ()))
        for attr in HELD_PARTS:
            if hasattr(module, attr):
                delattr(module, attr)
        for holder in (module, model.lm_head) if name == TIED else (module,):
            holder.weight = nn.Parameter(torch.empty(0, weight.in_features, dtype=dtype), requires_grad=False)
        module.quant = QuantRows(weight, dtype) if name == TIED else product
        if name == TIED:
            model.lm_head.quant = product
        held += weight.nbytes
    return held
