"""Model families by config.json's model_type, and the loader that builds one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open

from radixrt.models.config import ModelConfig
from radixrt.models.gemma import GemmaForCausalLM
from radixrt.models.llama import LlamaForCausalLM
from radixrt.models.parallel import TPGroup
from radixrt.models.phi3 import Phi3ForCausalLM

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
    path: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, tp: TPGroup = TPGroup()
) -> torch.nn.Module:
    """Build the model for cfg.model_type (this rank's shard) and fill it from the checkpoint."""
    if cfg.model_type not in MODEL_FAMILIES:
        raise ValueError(f"model_type {cfg.model_type!r} is not supported; known: {sorted(MODEL_FAMILIES)}")
    with torch.device(device):
        model = MODEL_FAMILIES[cfg.model_type](cfg, tp)
    model.load_weights(iter_safetensors(Path(path), device))
    return model.to(dtype=dtype).eval()


def reload_weights(model: torch.nn.Module, path: str | Path, device: torch.device) -> None:
    """Fill a built model's parameters in place from the checkpoint at path (same names and shapes;
    values converted to each parameter's dtype), so captured graphs and held references stay valid.
    A linear layer holding its own copy of a tied embedding (cpu_matmul.hold_linear_weights_in)
    is refreshed from the new embedding. On an exception the model is part old, part new."""
    model.load_weights(iter_safetensors(Path(path), device))
    head, embed = model.lm_head.weight, model.embed_tokens.weight
    if model.cfg.tie_word_embeddings and head is not embed:
        head.data.copy_(embed.data)


def iter_safetensors(path: Path, device: torch.device) -> Iterator[tuple[str, Any]]:
    """Lazy tensors of a checkpoint (one model.safetensors or the shards its index lists):
    indexing a slice reads only that part, so a rank never loads the whole model."""
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
