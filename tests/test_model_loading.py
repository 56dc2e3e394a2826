"""Checkpoint loading: a sharded safetensors index loads the same weights as one file,
and configs we cannot run faithfully are refused with the reason."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from radixrt.models import ModelConfig, load_model


def test_sharded_checkpoint_loads_the_same_weights(model_paths, tmp_path):
    from transformers import AutoModelForCausalLM

    for family, path in model_paths.items():
        sharded = tmp_path / family
        AutoModelForCausalLM.from_pretrained(path).save_pretrained(sharded, max_shard_size="200KB")
        assert (sharded / "model.safetensors.index.json").exists()
        assert len(list(sharded.glob("*.safetensors"))) > 1
        cfg = ModelConfig.from_dir(path)
        one = load_model(path, cfg, torch.float32, torch.device("cpu")).state_dict()
        many = load_model(sharded, ModelConfig.from_dir(sharded), torch.float32, torch.device("cpu")).state_dict()
        assert one.keys() == many.keys()
        for name in one:
            torch.testing.assert_close(one[name], many[name], rtol=0, atol=0)


def _with_config(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"model_type": "gpt_neox"}, "model_type 'gpt_neox' is not supported"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "rope_type 'dynamic'"),
        ({"hidden_act": "relu"}, "hidden_act 'relu'"),
        ({"model_type": "gemma3", "text_config": {"hidden_size": 64}, "vision_config": {}}, "'gemma3' is a multimodal"),
        ({"model_type": "gemma2", "use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 8}, "num_experts_per_tok 8"),
        ({"model_type": "qwen3", "layer_types": ["full_attention"] * 3 + ["chunked_attention"],
          "use_sliding_window": True, "sliding_window": 64}, "layer_types"),
    ],
)
def test_configs_we_cannot_run_are_refused_by_name(model_paths, tmp_path, changes, words):
    path = _with_config(model_paths["llama"], tmp_path / "changed", **changes)
    with pytest.raises(ValueError, match=words):
        ModelConfig.from_dir(path)


def test_every_family_has_a_config_reader_and_a_model():
    from radixrt.models.family_options import FAMILY_OPTIONS, HIDDEN_ACTS
    from radixrt.models.llama import ACTIVATIONS
    from radixrt.models.registry import MODEL_FAMILIES

    assert sorted(FAMILY_OPTIONS) == sorted(MODEL_FAMILIES)
    assert sorted(HIDDEN_ACTS) == sorted(ACTIVATIONS)


# config.json spellings of older transformers (no layer_types, rope_scaling, sliding_window_pattern, "su"),
# read as transformers 5 reads them.
SPELLINGS = {
    "gemma2": dict(num_hidden_layers=5, sliding_window=128, query_pre_attn_scalar=144),
    "gemma3_text": dict(num_hidden_layers=8, sliding_window=512, sliding_window_pattern=3, rope_theta=1000000.0,
                        rope_local_base_freq=10000.0, rope_scaling={"rope_type": "linear", "factor": 8.0}),
    "qwen2": dict(num_hidden_layers=6, use_sliding_window=True, sliding_window=256, max_window_layers=4),
    "qwen3_moe": dict(num_hidden_layers=6, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      decoder_sparse_step=2, mlp_only_layers=[3], use_sliding_window=True, sliding_window=100),
    "mistral": dict(num_hidden_layers=3, sliding_window=None),
    "mixtral": dict(num_hidden_layers=3, sliding_window=4096, num_local_experts=4, num_experts_per_tok=2),
    "phi3": dict(num_hidden_layers=2, original_max_position_embeddings=4096, max_position_embeddings=131072,
                 rope_scaling={"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                               "original_max_position_embeddings": 2048}),  # the top-level one wins
    "llama": dict(num_hidden_layers=2, original_max_position_embeddings=4096, max_position_embeddings=131072,
                  rope_scaling={"type": "yarn", "factor": 4.0}),  # not Phi-3: the top-level one is ignored
}  # fmt: skip


@pytest.mark.parametrize("model_type", sorted(SPELLINGS))
def test_family_options_are_read_as_transformers_reads_them(model_type, tmp_path):
    from transformers import AutoConfig

    raw = dict(model_type=model_type, vocab_size=64, hidden_size=64, intermediate_size=128, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, **SPELLINGS[model_type])  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(raw))
    ours = ModelConfig.from_dir(tmp_path)
    hf = AutoConfig.for_model(**raw)
    hf_window = getattr(hf, "sliding_window", None)
    types = getattr(hf, "layer_types", None) or ["sliding_attention" if hf_window else "full_attention"] * hf.num_hidden_layers
    want = [hf_window if t == "sliding_attention" else None for t in types]
    assert [a.window for a in ours.attention_layers()] == want
    if model_type.startswith("gemma"):
        assert ours.attention_layers()[0].scale == hf.query_pre_attn_scalar**-0.5
    if model_type == "gemma3_text":
        full, local = hf.rope_parameters["full_attention"], hf.rope_parameters["sliding_attention"]
        assert (ours.rope_theta, ours.rope_scaling) == (full["rope_theta"], {"rope_type": "linear", "factor": 8.0})
        assert (ours.sliding_rope_theta, ours.sliding_rope_scaling["rope_type"]) == (local["rope_theta"], "default")
    if model_type == "qwen3_moe":
        dense = hf.mlp_only_layers
        sparse = {i for i in range(6) if i not in dense and (i + 1) % hf.decoder_sparse_step == 0}
        assert ours.moe.layers == sparse == {1, 5} and ours.moe.num_experts == 8 and not ours.moe.renormalize
    if model_type == "mixtral":
        assert ours.moe.layers == {0, 1, 2} and ours.moe.num_experts == 4 and ours.moe.renormalize
    if model_type == "phi3":
        assert ours.rope_scaling["rope_type"] == hf.rope_parameters["rope_type"] == "longrope"
        original = ours.rope_scaling["original_max_position_embeddings"]
        assert original == hf.rope_parameters["original_max_position_embeddings"] == 4096
    if model_type == "llama":
        assert ours.rope_scaling["original_max_position_embeddings"] == hf.rope_parameters["original_max_position_embeddings"]


def test_missing_tensors_are_named(model_paths, tmp_path):
    from safetensors.torch import load_file, save_file

    path = tmp_path / "broken"
    shutil.copytree(model_paths["qwen2"], path)
    weights = load_file(path / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, path / "model.safetensors")
    with pytest.raises(ValueError, match="down_proj"):
        load_model(path, ModelConfig.from_dir(path), torch.float32, torch.device("cpu"))
