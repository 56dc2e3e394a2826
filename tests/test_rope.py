"""Our rotary frequencies, attention factors and rotations equal transformers' for every rope type
we accept, read from a config.json the way the runtime reads it."""

from __future__ import annotations

import pytest
import torch
from radixrt.models import ModelConfig
from radixrt.models.rope import RotaryEmbedding, rope_frequencies
from transformers import LlamaConfig, Phi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

HALF = 32  # head_dim 64
SHORT = [1.0 + 0.03 * i for i in range(HALF)]
LONG = [1.0 + 0.5 * i for i in range(HALF)]
CASES = {  # name -> (config class, its keyword arguments)
    "linear": (LlamaConfig, {"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 500000.0}}),
    "llama3": (LlamaConfig, {"rope_parameters": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 1024, "rope_theta": 500000.0}}),
    "yarn": (LlamaConfig, {"rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048, "rope_theta": 1000000.0}}),
    "yarn-mscale": (LlamaConfig, {"rope_parameters": {
        "rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "rope_theta": 10000.0,
        "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 16, "beta_slow": 2}}),
    "yarn-explicit": (LlamaConfig, {"rope_parameters": {
        "rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": 1000, "rope_theta": 10000.0,
        "attention_factor": 1.25, "truncate": False}}),
    # Phi-3 keeps original_max_position_embeddings at the top and no factor: it is max / original
    "longrope": (Phi3Config, {"original_max_position_embeddings": 1024, "rope_parameters": {
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": SHORT, "long_factor": LONG}}),
    "longrope-attention": (Phi3Config, {"original_max_position_embeddings": 1024, "rope_parameters": {
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": SHORT, "long_factor": LONG,
        "attention_factor": 1.1}}),
}  # fmt: skip


def _configs(name: str, tmp_path):
    """(transformers' config, ModelConfig read back from its config.json)."""
    cls, kwargs = CASES[name]
    hf = cls(hidden_size=256, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=8192,
             vocab_size=64, **kwargs)  # fmt: skip
    hf.save_pretrained(tmp_path)
    return hf, ModelConfig.from_dir(tmp_path)


@pytest.mark.parametrize("name", sorted(CASES))
def test_frequencies_and_attention_factor_match_transformers(name, tmp_path):
    hf, cfg = _configs(name, tmp_path)
    kind = cfg.rope_scaling["rope_type"]
    choices = [False, True] if kind == "longrope" else [False]
    for long in choices:
        original = cfg.rope_scaling.get("original_max_position_embeddings", 0)
        want, want_factor = ROPE_INIT_FUNCTIONS[kind](hf, torch.device("cpu"), seq_len=original + 1 if long else None)
        got = rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings, long)
        torch.testing.assert_close(got.inv_freq, want.float(), rtol=1e-6, atol=0)
        assert got.attention_factor == pytest.approx(want_factor, rel=1e-12)


def test_longrope_rotation_with_partial_rotary_matches_phi3(tmp_path):
    """Phi-4-mini style: a quarter of each head unrotated; short factors for positions of a sequence
    within the original context, long ones (and the attention factor on cos/sin) past it."""
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": SHORT[:24], "long_factor": LONG[:24],
            "partial_rotary_factor": 0.75}  # fmt: skip
    hf = Phi3Config(hidden_size=256, num_attention_heads=4, max_position_embeddings=8192, vocab_size=64,
                    original_max_position_embeddings=1024, rope_parameters=rope)  # fmt: skip
    hf.save_pretrained(tmp_path)
    cfg = ModelConfig.from_dir(tmp_path)
    assert cfg.partial_rotary_factor == 0.75
    ours = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling, 48)
    theirs = Phi3RotaryEmbedding(hf)
    gen = torch.Generator().manual_seed(0)
    for positions in (torch.arange(0, 1024, 37), torch.arange(900, 3000, 41)):  # a short and a long sequence
        q = torch.randn(len(positions), 4, 64, generator=gen)
        k = torch.randn(len(positions), 4, 64, generator=gen)
        cos, sin = theirs(q, positions[None])  # positions reach past 1024 -> the long factors
        want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
        long = torch.full_like(positions, bool(positions.max() >= 1024), dtype=torch.bool)
        got_q, got_k = ours(ours.table_rows(positions, long), q, k)
        torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_k, want_k[0].transpose(0, 1), rtol=1e-5, atol=1e-5)


def test_unsupported_rope_type_is_an_error():
    with pytest.raises(ValueError, match="dynamic"):
        rope_frequencies(64, 10000.0, {"rope_type": "dynamic", "factor": 4.0}, 4096)
