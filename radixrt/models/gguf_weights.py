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
Held where the CPU kernel builds and there is one rank (RADIXRT_GGUF_WEIGHTS=dequantize turns it off).
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from radixrt.kernels.quant_weights import FORMATS, QGemm, QuantWeight, held_rows, load_qgemm, pack
from radixrt.models.gguf_blocks import layer_format
from radixrt.models.weight_quant import int8_targets

logger = logging.getLogger(__name__)

MODE_ENV = "RADIXRT_GGUF_WEIGHTS"  # "quantized" (the default where it serves) or "dequantize"
TIED = "embed_tokens"  # a tied embedding held: the LM head's weight too
SUFFIXES = ("weight_scale", "weight_min")  # beside `weight`, what a held layer loads


PROBE_ROWS = (16, 64, 256)  # row counts at which start-up times the integer tiles against dequantizing per call
PROBE_ROUNDS = 5


class QuantLinear:
    """A layer's product through its held weight: x [.., K] -> x W^T [.., N] in x's dtype (float32 for any
    dtype but float32 and bf16)."""

    def __init__(self, weight: QuantWeight, kernel: QGemm, dequantize_rows: int | None = None) -> None:
        """dequantize_rows: from this many rows the weight is dequantized for the call and multiplied by the
        model dtype's GEMM (choose_dequantize_rows); None: never."""
        self.weight, self.kernel, self.dequantize_rows = weight, kernel, dequantize_rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.weight.in_features)
        dtype = x.dtype if x.dtype in (torch.float32, torch.bfloat16) else torch.float32
        if self.dequantize_rows is not None and rows.shape[0] >= self.dequantize_rows and dtype == x.dtype:
            y = F.linear(rows, self.kernel.dequantize(self.weight, dtype))
        else:
            y = self.kernel(rows, self.weight, dtype)
        return y.view(*x.shape[:-1], self.weight.out_features)


class QuantRows:
    """An embedding's lookup from a held weight (a tied LM head's): ids [T] -> rows [T, K] in dtype, each
    dequantized from the packed tiles as `dequantize` would."""

    def __init__(self, weight: QuantWeight, dtype: torch.dtype) -> None:
        self.weight, self.dtype = weight, dtype

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return held_rows(self.weight, ids.reshape(-1)).to(self.dtype)


def choose_dequantize_rows(weight: QuantWeight, kernel: QGemm, dtype: torch.dtype) -> tuple[int | None, str]:
    """The fewest of PROBE_ROWS rows at which dequantizing the weight per call and F.linear in dtype beats the
    integer tiles by 5% (median of PROBE_ROUNDS, on this layer's shape), or None; and the timings, for the log.
    Measured on this AVX-512-BF16 EPYC: 4-bit tiles 0.5-0.96x bf16's F.linear time at 1-256 rows (never
    dequantized), 8-bit ones 1.6x at 256 rows where dequantizing costs 1.4x."""
    timings = []
    for rows in PROBE_ROWS:
        x = torch.randn(rows, weight.in_features).to(dtype)
        tiles, dequantized = (_median_s(fn) for fn in (lambda: kernel(x, weight),
                                                       lambda: F.linear(x, kernel.dequantize(weight, dtype))))
        timings.append(f"{rows} rows {dequantized / tiles:.2f}x")
        if dequantized < 0.95 * tiles:
            return rows, ", ".join(timings)
    return None, ", ".join(timings)


def _median_s(fn) -> float:
    fn()
    times = []
    for _ in range(PROBE_ROUNDS):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def resident_layers(model: nn.Module, tensor_types: dict[str, str], device: torch.device, tp_size: int) -> dict[str, str]:
    """The linear layers to hold quantized (module name -> format name), from the GGUF tensors' types by the
    Hugging Face parameter they fill; {} (logged) where none can be."""
    mode = os.environ.get(MODE_ENV, "quantized").strip().lower()
    if mode not in ("quantized", "dequantize"):
        raise ValueError(f"{MODE_ENV}={mode!r}: choose quantized or dequantize")
    why = ("asked to dequantize" if mode == "dequantize" else "not on the CPU" if device.type != "cpu"
           else f"{tp_size} ranks (held quantized at one)" if tp_size != 1
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
    """Pack each held layer's loaded values into the kernel's layout and multiply through it (the
    placeholders dropped: `weight` stays an empty [0, in] tensor of the model's dtype); a tied embedding's
    becomes the LM head's product and the embedding's lookup. Returns the bytes held."""
    kernel, held, switch = load_qgemm(), 0, {}
    for name, fmt_name in layers.items():
        module = model.get_submodule(name)
        weight = pack(module.weight.data, module.weight_scale.data, getattr(module, "weight_min", None), FORMATS[fmt_name])
        if fmt_name not in switch and dtype in (torch.float32, torch.bfloat16):  # measured on the first layer of each
            switch[fmt_name] = choose_dequantize_rows(weight, kernel, dtype)
            logger.info("GGUF weights, %s: dequantized per call from %s rows (its time against the integer tiles: %s)",
                        fmt_name, switch[fmt_name][0], switch[fmt_name][1])
        product = QuantLinear(weight, kernel, switch.get(fmt_name, (None, ""))[0])
        for attr in SUFFIXES:
            if hasattr(module, attr):
                delattr(module, attr)
        for holder in (module, model.lm_head) if name == TIED else (module,):
            holder.weight = nn.Parameter(torch.empty(0, weight.in_features, dtype=dtype), requires_grad=False)
        module.quant = QuantRows(weight, dtype) if name == TIED else product
        if name == TIED:
            model.lm_head.quant = product
        held += weight.nbytes
    return held
