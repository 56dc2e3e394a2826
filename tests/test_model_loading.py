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


def test_sliding_window_models_are_refused(model_paths, tmp_path):
    path = tmp_path / "windowed"
    shutil.copytree(model_paths["llama"], path)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(sliding_window=256, model_type="mistral")
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="sliding_window"):
        ModelConfig.from_dir(path)


def test_missing_tensors_are_named(model_paths, tmp_path):
    from safetensors.torch import load_file, save_file

    path = tmp_path / "broken"
    shutil.copytree(model_paths["qwen2"], path)
    weights = load_file(path / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, path / "model.safetensors")
    with pytest.raises(ValueError, match="down_proj"):
        load_model(path, ModelConfig.from_dir(path), torch.float32, torch.device("cpu"))
