"""ModelConfig: what the runtime needs from a checkpoint's config.json.

Reads the file directly (no transformers import in the worker). Handles both
the transformers 4 spelling (rope_theta + rope_scaling, sliding_window_pattern)
and the transformers 5 one (rope_parameters, layer_types). What every family
has is read here; each family's own options come from its reader in
family_options.py, as typed fields. Whatever we cannot run faithfully (an
unknown model_type, activation, rope type, a nested multimodal config) is
refused here, naming it, before any weight is read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from radixrt.kernels.backend import LayerAttention
from radixrt.models.family_options import FAMILY_OPTIONS, HIDDEN_ACTS, SLIDING, refuse_nested, rope_spec
from radixrt.models.rope import ROPE_TYPES
from radixrt.settings.pooling import classifier_labels

REQUIRED_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    renormalize: bool  # the top-k routing weights are rescaled to sum to 1
    layers: frozenset[int]  # decoder layers whose MLP is the sparse block


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
    partial_rotary_factor: float = 1.0  # rotate only this fraction of each head's features
    attention_bias: bool = False  # on q/k/v
    o_proj_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    # a …ForSequenceClassification checkpoint's head outputs (its `score` layer; it has no lm_head, so its
    # output head is its input embeddings: served --is-embedding); 0: a causal LM
    num_labels: int = 0
    torch_dtype: str = "float32"
    eos_ids: tuple[int, ...] = ()
    hidden_act: str = "silu"  # of the gated MLP: silu or gelu_pytorch_tanh
    qk_norm: bool = False  # RMSNorm over each q and k head before the rope (Qwen3, Gemma 3)
    layer_types: tuple[str, ...] = ()  # per layer: "full_attention" or "sliding_attention"
    sliding_window: int | None = None  # positions a sliding layer's query sees, itself included
    query_pre_attn_scalar: float | None = None  # attention scale is its -0.5 power (Gemma); None: head_dim's
    attn_logit_softcap: float | None = None  # attention scores -> cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcap: float | None = None  # the same on the output logits
    sliding_rope_theta: float | None = None  # sliding layers' own rope (Gemma 3); None: the one rope
    sliding_rope_scaling: dict[str, Any] = field(default_factory=dict)
    moe: MoEConfig | None = None
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False)  # config.json: family-specific options

    def attention_layers(self) -> list[LayerAttention]:
        """How each layer attends (scale, sliding window, soft-capping)."""
        scale = (self.query_pre_attn_scalar or self.head_dim) ** -0.5
        windows = [self.sliding_window if t == SLIDING else None for t in self.layer_types]
        return [LayerAttention(scale, w, self.attn_logit_softcap) for w in windows]

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.exists():
            raise FileNotFoundError(f"model_path {path} has no config.json")
        c = json.loads(cfg_file.read_text())
        model_type = c.get("model_type")
        refuse_nested(c)
        if model_type not in FAMILY_OPTIONS:
            raise ValueError(f"model_type {model_type!r} is not supported; known: {sorted(FAMILY_OPTIONS)}")
        missing = [k for k in REQUIRED_KEYS if k not in c]
        if missing:
            raise ValueError(f"config.json (model_type {model_type!r}) lacks {missing}")
        heads = c["num_attention_heads"]
        common: dict[str, Any] = dict(
            model_type=model_type,
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c.get("intermediate_size", 0),
            num_layers=c["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            max_position_embeddings=c.get("max_position_embeddings", 2048),
            attention_bias=c.get("attention_bias", False),
            o_proj_bias=c.get("attention_bias", False),
            mlp_bias=c.get("mlp_bias", False),
            tie_word_embeddings=c.get("tie_word_embeddings", False) or classifier_labels(c) > 0,
            num_labels=classifier_labels(c),
            torch_dtype=str(c.get("dtype") or c.get("torch_dtype") or "float32"),
            eos_ids=_eos_ids(path, c),
            hidden_act=c.get("hidden_act", "silu"),
            raw=c,
        )
        common["rope_theta"], common["rope_scaling"] = rope_spec(c, c.get("rope_parameters") or c.get("rope_scaling"))
        common["partial_rotary_factor"] = common["rope_scaling"].pop("partial_rotary_factor", 1.0)
        options = FAMILY_OPTIONS[model_type](c)
        if "moe" in options:
            options["moe"] = MoEConfig(**options["moe"])
        return cls(**{**common, **options})

    def __post_init__(self) -> None:
        """Refuse what the model code cannot run as transformers does, naming it."""
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full_attention",) * self.num_layers)
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported ({', '.join(HIDDEN_ACTS)})")
        for scaling in (self.rope_scaling, self.sliding_rope_scaling):
            kind = scaling.get("rope_type", "default")
            if kind not in ROPE_TYPES:
                raise ValueError(f"rope_type {kind!r} is not supported ({', '.join(ROPE_TYPES)})")
        if self.intermediate_size <= 0 and (self.moe is None or len(self.moe.layers) < self.num_layers):
            raise ValueError(f"config.json (model_type {self.model_type!r}) lacks intermediate_size")
        if len(self.layer_types) != self.num_layers or set(self.layer_types) - {SLIDING, "full_attention"}:
            raise ValueError(f"layer_types {list(self.layer_types)} are not {self.num_layers} of full/sliding_attention")
        if self.moe is not None and not 0 < self.moe.top_k <= self.moe.num_experts:
            raise ValueError(f"num_experts_per_tok {self.moe.top_k} is not within 1..num_experts {self.moe.num_experts}")


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
