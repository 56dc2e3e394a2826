"""How each model family's config.json spells its own options, read into ModelConfig fields.

FAMILY_OPTIONS maps model_type to a reader: config.json dict -> the ModelConfig
fields that differ from the Llama defaults (config.py reads those). Defaults for
keys a config.json leaves out are transformers 5's config-class defaults, and
where transformers ignores a key (Mistral's layer_types, Gemma 3's attention
soft-capping) so do we: the reference is what transformers computes.
"""

from __future__ import annotations

from typing import Any, Callable

SLIDING, FULL = "sliding_attention", "full_attention"
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")  # the decoder's activations (llama.ACTIVATIONS)
_SCALED_ROPES = ("llama3", "yarn", "longrope")  # rope types that know the pre-training length

Options = dict[str, Any]


def refuse_nested(c: dict[str, Any]) -> None:
    """A multimodal checkpoint nests its language model's config: refuse it by name."""
    nested = [k for k in ("text_config", "vision_config", "audio_config") if k in c]
    if nested:
        hint = "; its text-only sibling gemma3_text is" if c.get("model_type") == "gemma3" else ""
        raise ValueError(
            f"model_type {c.get('model_type')!r} is a multimodal config (nested {', '.join(nested)}): not supported{hint}"
        )


def rope_spec(
    c: dict[str, Any], params: dict[str, Any] | None, theta: float = 10000.0, original: int | None = None
) -> tuple[float, dict[str, Any]]:
    """(rope_theta, scaling parameters with rope_type) from one rope dict, as transformers standardizes it:
    its original_max_position_embeddings defaults to max_position_embeddings, and `original` (Phi-3's
    top-level one) overrides it."""
    rope = dict(params or {})
    theta = rope.pop("rope_theta", c.get("rope_theta", theta))
    rope.setdefault("rope_type", rope.pop("type", "default"))
    if "partial_rotary_factor" in c:
        rope.setdefault("partial_rotary_factor", c["partial_rotary_factor"])
    if rope["rope_type"] in _SCALED_ROPES:
        if original is not None:
            rope["original_max_position_embeddings"] = original
        rope.setdefault("original_max_position_embeddings", c.get("max_position_embeddings"))
    return float(theta), rope


def _every_layer_windowed(c: dict[str, Any], window: int | None) -> Options:
    """One sliding window on every layer (Mistral, Mixtral, Phi-3, Qwen3-MoE), or none."""
    if window is None:
        return {}
    return {"sliding_window": window, "layer_types": (SLIDING,) * c["num_hidden_layers"]}


def _qwen_windows(c: dict[str, Any]) -> Options:
    """Qwen2/Qwen3: with use_sliding_window, the layers from max_window_layers on slide (or as layer_types says)."""
    window = c.get("sliding_window", 4096) if c.get("use_sliding_window", False) else None
    if window is None:
        return {}
    n, first = c["num_hidden_layers"], c.get("max_window_layers", 28)
    types = c.get("layer_types") or [SLIDING if i >= first else FULL for i in range(n)]
    return {"sliding_window": window, "layer_types": tuple(types)}


def _llama(c: dict[str, Any]) -> Options:
    return {}


def _mistral(c: dict[str, Any]) -> Options:
    return {"attention_bias": False, "o_proj_bias": False, **_every_layer_windowed(c, c.get("sliding_window"))}


def _qwen2(c: dict[str, Any]) -> Options:
    return {"attention_bias": True, "o_proj_bias": False, **_qwen_windows(c)}  # q/k/v biased, o not


def _qwen3(c: dict[str, Any]) -> Options:
    return {"qk_norm": True, **_qwen_windows(c)}


def _num_experts(c: dict[str, Any], default: int) -> int:
    # transformers 5 saves Hub's num_experts as num_local_experts (an attribute_map alias), Mixtral the reverse
    return c.get("num_experts", c.get("num_local_experts", default))


def _qwen3_moe(c: dict[str, Any]) -> Options:
    window = c.get("sliding_window", 4096) if c.get("use_sliding_window", False) else None
    n, step, dense = c["num_hidden_layers"], c.get("decoder_sparse_step", 1), set(c.get("mlp_only_layers") or [])
    experts = _num_experts(c, 128)
    sparse = frozenset(i for i in range(n) if i not in dense and experts > 0 and (i + 1) % step == 0)
    moe = dict(num_experts=experts, top_k=c.get("num_experts_per_tok", 8), intermediate_size=c.get("moe_intermediate_size", 768),
               renormalize=c.get("norm_topk_prob", False), layers=sparse)  # fmt: skip
    return {"qk_norm": True, **_every_layer_windowed(c, window), **({"moe": moe} if sparse else {})}


def _mixtral(c: dict[str, Any]) -> Options:
    every = frozenset(range(c["num_hidden_layers"]))
    moe = dict(num_experts=_num_experts(c, 8), top_k=c.get("num_experts_per_tok", 2),
               intermediate_size=c["intermediate_size"], renormalize=True, layers=every)  # fmt: skip
    return {**_mistral(c), "moe": moe}


def _phi3(c: dict[str, Any]) -> Options:
    # Phi3Config keeps original_max_position_embeddings at the top (default 4096), where it wins
    # over the rope dict's, and reads the old rope names "su" and "yarn" as longrope.
    params = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    if params.get("rope_type", params.get("type")) in ("su", "yarn"):
        params["rope_type"] = "longrope"
    theta, scaling = rope_spec(c, params, original=c.get("original_max_position_embeddings", 4096))
    return {"attention_bias": False, "o_proj_bias": False, "rope_theta": theta, "rope_scaling": scaling,
            "partial_rotary_factor": scaling.pop("partial_rotary_factor", 1.0),
            **_every_layer_windowed(c, c.get("sliding_window"))}  # fmt: skip


def _gemma(c: dict[str, Any], pattern: int) -> Options:
    """What Gemma 2 and Gemma 3 share: GeGLU, tied embeddings, query_pre_attn_scalar, and
    sliding layers every `pattern`-th layer but the last of each group (unless layer_types says)."""
    if c.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention (an encoder-style Gemma) is not supported")
    n = c["num_hidden_layers"]
    types = c.get("layer_types") or [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
    return {"hidden_act": c.get("hidden_activation") or "gelu_pytorch_tanh",
            "tie_word_embeddings": c.get("tie_word_embeddings", True),
            "query_pre_attn_scalar": c.get("query_pre_attn_scalar", 256),
            "sliding_window": c.get("sliding_window", 4096), "layer_types": tuple(types)}  # fmt: skip


def _gemma2(c: dict[str, Any]) -> Options:
    return {**_gemma(c, pattern=2), "attn_logit_softcap": c.get("attn_logit_softcapping", 50.0),
            "final_logit_softcap": c.get("final_logit_softcapping", 30.0)}  # fmt: skip


def _gemma3_text(c: dict[str, Any]) -> Options:
    # Ropes: transformers 5 nests one per layer type; transformers 4 had rope_theta and rope_scaling
    # for the full layers and rope_local_base_freq for the sliding ones. transformers passes no
    # attention soft-capping to Gemma 3's attention, whatever the config says.
    params = c.get("rope_parameters") or {}
    if FULL in params or SLIDING in params:
        full, local = params.get(FULL) or {}, params.get(SLIDING) or {}
    else:
        full, local = c.get("rope_scaling") or {}, {"rope_theta": c.get("rope_local_base_freq", 10000.0)}
    theta, scaling = rope_spec(c, full, theta=1_000_000.0)
    local_theta, local_scaling = rope_spec({}, local, theta=10000.0)
    return {**_gemma(c, pattern=c.get("sliding_window_pattern", 6)), "qk_norm": True,
            "final_logit_softcap": c.get("final_logit_softcapping"), "rope_theta": theta, "rope_scaling": scaling,
            "sliding_rope_theta": local_theta, "sliding_rope_scaling": local_scaling}  # fmt: skip


FAMILY_OPTIONS: dict[str, Callable[[dict[str, Any]], Options]] = {
    "llama": _llama,
    "mistral": _mistral,
    "mixtral": _mixtral,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "qwen3_moe": _qwen3_moe,
    "phi3": _phi3,
    "gemma2": _gemma2,
    "gemma3_text": _gemma3_text,
}
