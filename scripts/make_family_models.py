"""Build one tiny, deterministic Hugging Face checkpoint per model family beyond llama-tiny/qwen2-tiny.

Each is made by transformers' own config and model classes and `save_pretrained` (float32,
2 layers, hidden 64, the 1024-token tokenizer of make_tiny_model.py), with the options that
family's runtime code must get right set to values the test prompts exercise:

  qwen3        explicit head_dim (32, not hidden / heads), per-head q/k RMSNorm
  qwen3_moe    8 experts, top-2, norm_topk_prob, decoder_sparse_step 2 (layer 0 dense, 1 sparse)
  mixtral      4 experts, top-2, every layer sparse
  gemma2       sliding window 32 on layer 0, attention and final logit soft-capping, query_pre_attn_scalar 24
  gemma3_text  sliding window 32, layer_types, local rope theta, linear rope scaling on the full layer
  phi3         longrope with original_max_position_embeddings 64 (prompts cross it, some only while decoding)
  mistral      sliding window 32 on every layer
  qwen2_yarn   Qwen2 with YaRN rope scaling

They are built under `<repo>/models/<name>-tiny` (git-ignored) and rebuilt when this file,
make_tiny_model.py or the corpus change. Nothing is downloaded. Usage:

    python scripts/make_family_models.py [--name qwen3 ...]

or, from tests, `from make_family_models import ensure_family_model; path = ensure_family_model("gemma2")`.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

from make_tiny_model import (  # noqa: E402  (also imports transformers with the repo root off sys.path)
    DEFAULT_MODELS_ROOT,
    TINY_INIT_RANGE,
    TINY_NORM_WEIGHT_STD,
    _common_config,
    _generation_config,
    builder_fingerprint,
    ensure_built,
    tokenizer_for,
)

import torch  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    MistralConfig,
    MixtralConfig,
    Phi3Config,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

WINDOW = 32  # sliding window: most test prompts are longer
LONGROPE_ORIGINAL = 64  # phi3: prompts longer than this use the long factors
# A fixed seed per checkpoint, chosen so that greedy decoding of the test prompts has no
# near-ties between the top two logits (tests/test_model_families.py checks the gaps).
SEEDS = {"qwen3": 11, "qwen3_moe": 12, "mixtral": 13, "gemma2": 14, "gemma3_text": 15, "phi3": 16, "mistral": 27,
         "qwen2_yarn": 18}  # fmt: skip
FINAL_NORM_SCALE = 2.0  # the final norm's effective weight is scaled so logits are not flat (make_tiny_model.py)
BIAS_STD = 0.1

# Sizes every family shares; head_dim 16 unless the family sets its own.
BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=4096, rms_norm_eps=1e-6, initializer_range=TINY_INIT_RANGE)  # fmt: skip


def _longrope_factors() -> tuple[list[float], list[float]]:
    """Short factors near 1, long ones 1..16: the two choices give clearly different rotations."""
    half = 8  # head_dim 16 / 2
    return [1.0 + 0.05 * i for i in range(half)], [float(2 ** (4 * i / (half - 1))) for i in range(half)]


def _configs(vocab: int, common: dict[str, Any]) -> dict[str, Callable[[], PretrainedConfig]]:
    kw = dict(vocab_size=vocab, **BASE, **common)
    short, long = _longrope_factors()
    return {
        "qwen3": lambda: Qwen3Config(**kw, head_dim=32, tie_word_embeddings=False,
                                     rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        "qwen3_moe": lambda: Qwen3MoeConfig(**kw, head_dim=16, num_experts=8, num_experts_per_tok=2,
                                            moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=2,
                                            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        "mixtral": lambda: MixtralConfig(**{**kw, "intermediate_size": 64}, num_local_experts=4,
                                         num_experts_per_tok=2, sliding_window=None,
                                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        "gemma2": lambda: Gemma2Config(**kw, head_dim=32, query_pre_attn_scalar=24, sliding_window=WINDOW,
                                       attn_logit_softcapping=5.0, final_logit_softcapping=8.0,
                                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        "gemma3_text": lambda: Gemma3TextConfig(
            **kw, head_dim=32, query_pre_attn_scalar=32, sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}}),
        "phi3": lambda: Phi3Config(
            **kw, original_max_position_embeddings=LONGROPE_ORIGINAL, tie_word_embeddings=False,
            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": short, "long_factor": long}),
        "mistral": lambda: MistralConfig(**kw, head_dim=16, sliding_window=WINDOW, tie_word_embeddings=False,
                                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        "qwen2_yarn": lambda: Qwen2Config(
            **kw, tie_word_embeddings=True, use_sliding_window=False,
            rope_parameters={"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                             "original_max_position_embeddings": 1024}),
    }  # fmt: skip


FAMILY_NAMES = tuple(SEEDS)


def _tokenizer(name: str):
    # transformers 5 loads every Qwen model_type with Qwen2's tokenizer pipeline (make_tiny_model.py)
    return tokenizer_for("qwen2" if name.startswith("qwen") else "llama")


def _shape_weights(model: PreTrainedModel, gemma: bool) -> None:
    """Random norm weights and biases (a runtime that drops one is visibly wrong), and a larger final norm.
    Gemma's norms scale by (1 + weight), so theirs are drawn around 0 instead of 1."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(mean=0.0 if gemma else 1.0, std=TINY_NORM_WEIGHT_STD)
            elif name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias", "o_proj.bias")):
                param.normal_(mean=0.0, std=BIAS_STD)
        final = model.model.norm.weight
        if gemma:
            final.copy_((1.0 + final) * FINAL_NORM_SCALE - 1.0)
        else:
            final.mul_(FINAL_NORM_SCALE)


def make_family_model(name: str, out_dir: Path) -> Path:
    """Write the deterministic random-weight checkpoint `name` (safetensors + tokenizer) into out_dir."""
    if name not in SEEDS:
        raise ValueError(f"unknown family checkpoint {name!r}; known: {list(SEEDS)}")
    tokenizer = _tokenizer(name)
    config = _configs(len(tokenizer), _common_config(tokenizer))[name]()
    torch.manual_seed(SEEDS[name])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _shape_weights(model, gemma=name.startswith("gemma"))
    model.generation_config = _generation_config(tokenizer)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.eval().save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def family_fingerprint() -> str:
    h = hashlib.sha256(builder_fingerprint().encode())
    h.update(Path(__file__).resolve().read_bytes())
    return h.hexdigest()


def ensure_family_model(name: str, root: Path | None = None) -> Path:
    """Return root/f"{name}-tiny", building it first if it is missing or stale (one builder at a time)."""
    root = Path(root) if root is not None else DEFAULT_MODELS_ROOT
    return ensure_built(root / f"{name}-tiny", family_fingerprint(), lambda tmp: make_family_model(name, tmp))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", choices=FAMILY_NAMES, action="append", help="default: all")
    parser.add_argument("--out", type=Path, help="write here (always rebuilds; one --name) instead of models/")
    args = parser.parse_args(argv)
    names = args.name or list(FAMILY_NAMES)
    if args.out is not None:
        if len(names) != 1:
            parser.error("--out takes exactly one --name")
        print(make_family_model(names[0], args.out))
        return 0
    for name in names:
        print(ensure_family_model(name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
