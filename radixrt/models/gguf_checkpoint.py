"""A GGUF file's weights under Hugging Face names, dequantized one tensor at a time.

A sidecar directory (utils/gguf_sidecar.py) names the .gguf file its weights stay in.
`iter_gguf` yields (hf_name, float32 CPU tensor) pairs, what a model's load_weights takes
from a safetensors checkpoint, reading the file as transformers does, so that both serve the
same values:

  * the tensor table is read with transformers' GGUF header reader (GgufHeader: struct-based,
    milliseconds; the gguf package's GGUFReader parses every vocabulary string through numpy
    first, ~5 s for a 49k-token vocabulary on a slow CPU), each tensor's bytes from a memory map,
    and dequantized by the gguf package (gguf.dequantize, what transformers uses) to float32;
  * transformers' per-architecture tensor processor (TENSOR_PROCESSORS) undoes what llama.cpp's
    converter did: the q/k row permutation of llama files, Gemma's `1 + w` norms, the Qwen-MoE
    experts stacked per projection (merged into one gate_up_proj, as transformers holds them);
  * the names come from gguf's HF -> GGUF name map, inverted over the parameter names of the
    transformers model the config describes (built on the meta device: no memory), with the
    processor's fallback for the merged experts, as transformers' get_gguf_hf_weights_map maps
    them. That function also walks every submodule and rebuilds the name map for each (16 s for
    a 30-layer model here), which only Bloom-style files need; the families radixrt serves are
    named in full by the model's own parameter names.

GGUF tensors with no parameter (llama.cpp's rope_freqs, say) are skipped, as transformers skips them.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from radixrt.utils.checkpoint_meta import TensorMeta
from radixrt.utils.gguf_sidecar import GgufSource, gguf_source

logger = logging.getLogger(__name__)


def iter_gguf(model_dir: Path, keep: dict[str, str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights of the GGUF file the sidecar model_dir names: (Hugging Face name, float32 CPU
    tensor), one tensor dequantized at a time (the Qwen-MoE gate and up experts of a layer held
    until both are read). A tensor whose Hugging Face name is in `keep` comes as its blocks instead, in
    the format keep names (gguf_blocks.unpack): `name` its values, `name_scale` and (4 and 5 bits)
    `name_min` its scales and mins, each through the same tensor processor (a row permutation). Raises ValueError when the
    file changed since the sidecar was built."""
    import gguf

    from radixrt.models.gguf_blocks import unpack

    source, config = _source_and_config(model_dir)
    header = _header_reader().from_file(source.path)
    processor = _processor(source.architecture, config)
    process_tensor = processor.process  # transformers' TensorProcessor (not a scheduler's process())
    names = hf_names(config, source.architecture, processor)
    blob = np.memmap(source.path, mode="r", dtype=np.uint8)
    parsed: dict[str, dict[str, torch.Tensor]] = {"tensors": {}}  # where processors leave merged tensors
    wanted = Counter(_target(names, info.name) for info in header.tensors)
    fed: Counter[str | None] = Counter()
    skipped = []
    for info in header.tensors:
        qtype = gguf.GGMLQuantizationType(info.ggml_type)
        start = header.data_start + info.offset
        raw = blob[start : start + info.nbytes].reshape(gguf.quant_shape_to_byte_shape(info.shape, qtype))
        if names.get(info.name) in (keep or {}):
            parts = unpack(raw, qtype.name, *info.shape, keep[names[info.name]])[:3]
            for suffix, part in zip(("", "_scale", "_min"), parts):
                if part is not None:
                    held = process_tensor(weights=part.numpy(), name=info.name, tensor_key_mapping=names, parsed_parameters=parsed)
                    yield names[held.name] + suffix, torch.from_numpy(np.ascontiguousarray(held.weights))
            continue
        values = gguf.dequantize(raw, qtype)  # float32, info.shape
        result = process_tensor(weights=values, name=info.name, tensor_key_mapping=names, parsed_parameters=parsed)
        if result.name is None:  # merged into parsed["tensors"] by the processor
            target = _target(names, info.name)
            fed[target] += 1
            if target in parsed["tensors"] and fed[target] == wanted[target]:
                yield target, parsed["tensors"].pop(target)
        elif result.name in names:
            yield names[result.name], torch.from_numpy(np.require(result.weights, np.float32, ["C", "W"]))
        else:
            skipped.append(info.name)
    yield from parsed["tensors"].items()
    if skipped:
        logger.info("GGUF tensors with no parameter in the model, skipped: %s", ", ".join(skipped))


def _header_reader() -> Any:
    """transformers' GGUF header reader; an older transformers lacks it: say so, by name. Its table of block
    sizes lacks types the gguf package dequantizes (Q5_0 and Q5_1: what llama.cpp's K-quant mixes fall back
    to on rows not a multiple of 256, as SmolLM2's 576); the header only needs their sizes, so the gguf
    package's are added for the types it lacks (the tensors themselves are dequantized by gguf here)."""
    import gguf

    try:
        from transformers.integrations.gguf import GgufHeader
        from transformers.integrations.gguf.dequant import GGML_BLOCK
    except ImportError:
        import transformers

        raise ValueError(f"GGUF checkpoints need transformers.integrations.gguf.GgufHeader, which transformers "
                         f"{transformers.__version__} lacks: upgrade transformers") from None
    for qtype in (gguf.GGMLQuantizationType.Q5_0, gguf.GGMLQuantizationType.Q5_1):
        GGML_BLOCK.setdefault(int(qtype), gguf.GGML_QUANT_SIZES[qtype])
    return GgufHeader


def gguf_tensor_meta(model_dir: Path) -> dict[str, TensorMeta]:
    """The tensors iter_gguf yields, by name, with their shapes (as F32), from the header alone."""
    source, config = _source_and_config(model_dir)
    names = hf_names(config, source.architecture, _processor(source.architecture, config))
    out: dict[str, TensorMeta] = {}
    for info in _header_reader().from_file(source.path).tensors:
        target = _target(names, info.name)
        if target is None:
            continue
        shape = info.shape
        if target in out:  # a Qwen-MoE gate_up_proj: gate and up experts stacked on dim 1
            prev = out[target].shape
            shape = (prev[0], prev[1] + shape[1], *prev[2:])
        out[target] = TensorMeta("F32", tuple(shape))
    return out


def tensor_types(model_dir: Path) -> dict[str, str]:
    """Hugging Face parameter name -> the GGUF type (Q4_1, F32 ...) of the tensor that fills it, from the header
    (merged experts, which fill one parameter from several tensors, are left out)."""
    import gguf

    source, config = _source_and_config(model_dir)
    names = hf_names(config, source.architecture, _processor(source.architecture, config))
    return {names[info.name]: gguf.GGMLQuantizationType(info.ggml_type).name
            for info in _header_reader().from_file(source.path).tensors if info.name in names}


def hf_names(config: dict[str, Any], architecture: str, processor: Any) -> dict[str, str]:
    """GGUF tensor name -> the Hugging Face parameter it fills, for the transformers model config
    describes. Merged experts are keyed without `.weight` (`blk.0.ffn_gate_exps`), as transformers'
    processors look them up."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    arch = next(a for a, name in MODEL_ARCH_NAMES.items() if name == architecture)
    name_map = get_tensor_name_map(arch, hf_config.num_hidden_layers)
    names: dict[str, str] = {}
    for param in model.state_dict():
        hf_name = processor.preprocess_name(param)
        stem, dot, kind = hf_name.rpartition(".")
        stem, suffix = (stem, dot + kind) if kind in ("weight", "bias") else (hf_name, "")
        gguf_name = name_map.get_name(stem)
        if gguf_name is None:
            processor.perform_fallback_tensor_mapping(names, suffix, "", hf_name)
        else:
            names[gguf_name + suffix] = hf_name
    return names


def _source_and_config(model_dir: Path) -> tuple[GgufSource, dict[str, Any]]:
    source = gguf_source(model_dir)
    if source is None:
        raise ValueError(f"{model_dir} is not a GGUF sidecar directory (no gguf_source.json)")
    source.check_unchanged()
    return source, json.loads((Path(model_dir) / "config.json").read_text())


def _processor(architecture: str, config: dict[str, Any]) -> Any:
    """transformers' tensor processor for the architecture (what its GGUF loader uses)."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    return gguf_utils.TENSOR_PROCESSORS.get(architecture, gguf_utils.TensorProcessor)(config=config)


def _target(names: dict[str, str], gguf_name: str) -> str | None:
    """The parameter a GGUF tensor fills: by its name, or a merged expert's without `.weight`."""
    return names.get(gguf_name) or names.get(gguf_name.removesuffix(".weight"))
