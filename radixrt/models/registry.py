"""Model families by config.json's model_type, and the loader that builds one."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from radixrt.kernels.fused_layers import QUANTIZED_ACT_DTYPES, TORCH_LAYERS, load_fused_layers
from radixrt.models.config import ModelConfig
from radixrt.models.fp8_checkpoint import dequantize_fp8
from radixrt.models.gemma import GemmaForCausalLM
from radixrt.models.held_steps import HeldSteps
from radixrt.models.gguf_weights import TIED, hold_placeholders, pack_layers, resident_layers
from radixrt.models.int4_weights import quantize_layers
from radixrt.models.llama import LlamaForCausalLM, use_layer_ops
from radixrt.models.parallel import TPGroup
from radixrt.models.phi3 import Phi3ForCausalLM
from radixrt.models.weight_quant import (
    hold_int8_placeholders,
    quantize_linear_weights,
    without_zero_points,
)
from radixrt.settings.quant import WeightScheme

UNQUANTIZED = WeightScheme("none", "unquantized")

# Every model_type here has a config reader in family_options.FAMILY_OPTIONS (a test checks both lists).
MODEL_FAMILIES: dict[str, type[torch.nn.Module]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "mixtral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "qwen3_moe": LlamaForCausalLM,
    "phi3": Phi3ForCausalLM,
    "gemma2": GemmaForCausalLM,
    "gemma3_text": GemmaForCausalLM,
}


def load_model(
    path: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, tp: TPGroup = TPGroup(),
    scheme: WeightScheme = UNQUANTIZED,
) -> torch.nn.Module:
    """Build the model for cfg.model_type (this rank's shard), in dtype, and fill it from the
    checkpoint; an int8 scheme's linear layers end up int8 (weight_quant.py): loaded so from a
    pre-quantized checkpoint, or quantized after loading. (Casting before loading rounds each
    tensor once, as loading then casting would.)"""
    if cfg.model_type not in MODEL_FAMILIES:
        raise ValueError(f"model_type {cfg.model_type!r} is not supported; known: {sorted(MODEL_FAMILIES)}")
    with torch.device(device):
        model = MODEL_FAMILIES[cfg.model_type](cfg, tp).to(dtype=dtype)
    int8 = scheme.name in ("w8a8_int8", "int8wo")
    if int8 and scheme.prequantized:
        hold_int8_placeholders(model)
    held, keep = _gguf_layers(model, Path(path), device) if scheme.name == "gguf" else ({}, {})
    weights = iter_safetensors(Path(path), device, keep)
    if scheme.name == "fp8":
        weights = dequantize_fp8(weights, dtype)
    elif int8 and scheme.prequantized:
        weights = without_zero_points(weights)
    model.load_weights(weights)
    if int8 and not scheme.prequantized:
        quantize_linear_weights(model, tp)
    if scheme.name == "int4wo":
        held = quantize_layers(model, scheme.group, device)
    # the linear layers held in 4-, 5- or 8-bit tiles (a GGUF file's blocks, or int4wo), their bytes, whether
    # a tied embedding is, and how many layers each format holds (gguf_weights.py)
    formats = Counter(fmt for name, fmt in held.items() if name != TIED)
    model.quant_held = (formats.total(), pack_layers(model, held, dtype), TIED in held, dict(sorted(formats.items()))) if held else None
    if held and model.layer_ops is not TORCH_LAYERS:  # activations rounded to int8 before every product
        use_layer_ops(model, load_fused_layers(QUANTIZED_ACT_DTYPES) or model.layer_ops)
        model.held_steps = HeldSteps.of(model)
    return model.eval()


def _gguf_layers(model: torch.nn.Module, path: Path, device: torch.device) -> tuple[dict[str, str], dict[str, str]]:
    """The linear layers a GGUF file's blocks fill as they are (placeholders held), and the Hugging Face
    names of the tensors that fill them, each with its layer's format."""
    from radixrt.models.gguf_checkpoint import tensor_types

    types = tensor_types(path)
    held = resident_layers(model, types, device)
    hold_placeholders(model, held)
    layer_of = {n: model._shard_plan(n.removeprefix("model."))[0].removesuffix(".weight") for n in types}
    return held, {n: held[layer] for n, layer in layer_of.items() if layer in held}


def reload_weights(model: torch.nn.Module, path: str | Path, device: torch.device) -> None:
    """Fill a built model's parameters in place from the checkpoint at path (same names and shapes;
    values converted to each parameter's dtype), so captured graphs and held references stay valid.
    A linear layer holding its own copy of a tied embedding (cpu_matmul.hold_linear_weights_in)
    is refreshed from the new embedding. On an exception the model is part old, part new."""
    model.load_weights(iter_safetensors(Path(path), device))
    head, embed = model.lm_head.weight, model.embed_tokens.weight
    if model.cfg.tie_word_embeddings and head is not embed:
        head.data.copy_(embed.data)


def iter_safetensors(path: Path, device: torch.device, keep: dict[str, str] | None = None) -> Iterator[tuple[str, Any]]:
    """Lazy tensors of a checkpoint (one model.safetensors or the shards its index lists):
    indexing a slice reads only that part, so a rank never loads the whole model. A GGUF
    sidecar directory (utils/gguf_sidecar.py) yields its GGUF file's tensors instead, whole,
    dequantized to float32 on the CPU one at a time, but those named in `keep`, which come as
    their blocks in the format named (gguf_checkpoint.iter_gguf)."""
    # imported here: this function is registry.py's one GGUF hook
    from radixrt.models.gguf_checkpoint import iter_gguf
    from radixrt.utils.gguf_sidecar import gguf_source

    if gguf_source(path) is not None:
        yield from iter_gguf(path, keep or {})
        return
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    for file in files:
        with safe_open(str(path / file), framework="pt", device=str(device)) as f:
            for name in f.keys():
                yield name, f.get_slice(name)
