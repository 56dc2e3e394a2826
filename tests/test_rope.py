"""Our rotary frequencies equal transformers' for every rope type we accept."""

from __future__ import annotations

import pytest
import torch
from radixrt.models.rope import inv_frequencies
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

CASES = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 1024,
    },
}


@pytest.mark.parametrize("kind", sorted(CASES))
def test_inv_frequencies_match_transformers(kind):
    params = dict(CASES[kind], rope_theta=500000.0)
    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=8192, rope_parameters=params)
    want, _ = ROPE_INIT_FUNCTIONS[kind](cfg, torch.device("cpu"))
    got = inv_frequencies(64, 500000.0, dict(CASES[kind]))
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)


def test_unsupported_rope_type_is_an_error():
    with pytest.raises(ValueError, match="yarn"):
        inv_frequencies(64, 10000.0, {"rope_type": "yarn", "factor": 4.0})
