"""ModelConfig: what the runtime needs from a checkpoint's config.json.

Reads the file directly (no transformers import in the worker). Handles both
the transformers 4 spelling (rope_theta + rope_scaling) and the transformers 5
one (rope_parameters).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict[str, Any] = field(default_factory=dict)  # rope_type and its parameters
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    torch_dtype: str = "float32"
    eos_ids: tuple[int, ...] = ()

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.exists():
            raise FileNotFoundError(f"model_path {path} has no config.json")
        c = json.loads(cfg_file.read_text())
        if c.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {c['hidden_act']!r} is not supported (silu only)")
        window = c.get("sliding_window")
        if window and c.get("use_sliding_window", True) and window < c.get("max_position_embeddings", 0):
            raise ValueError(f"sliding_window attention ({window} tokens) is not supported; this model needs it")
        missing = [k for k in REQUIRED_KEYS if k not in c]
        if missing:  # e.g. GPT-2's config.json, which names its sizes n_head, n_embd, ...
            raise ValueError(
                f"config.json (model_type {c.get('model_type')!r}) lacks {missing}: not a Llama-family model"
            )
        heads = c["num_attention_heads"]
        rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", c.get("rope_theta", 10000.0))
        rope.setdefault("rope_type", rope.pop("type", "default"))
        model_type = c.get("model_type", "llama")
        return cls(
            model_type=model_type,
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_layers=c["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            max_position_embeddings=c.get("max_position_embeddings", 2048),
            rope_theta=float(theta),
            rope_scaling=rope,
            # Qwen2 always has q/k/v bias; Llama and Mistral say so in attention_bias.
            attention_bias=c.get("attention_bias", model_type == "qwen2"),
            mlp_bias=c.get("mlp_bias", False),
            tie_word_embeddings=c.get("tie_word_embeddings", False),
            torch_dtype=str(c.get("dtype") or c.get("torch_dtype") or "float32"),
            eos_ids=_eos_ids(path, c),
        )


def _eos_ids(path: Path, c: dict[str, Any]) -> tuple[int, ...]:
    """eos ids from config.json and generation_config.json together."""
    ids: list[int] = []
    gen = path / "generation_config.json"
    sources = [c] + ([json.loads(gen.read_text())] if gen.exists() else [])
    for src in sources:
        eos = src.get("eos_token_id")
        for i in eos if isinstance(eos, list) else [eos]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return tuple(ids)
