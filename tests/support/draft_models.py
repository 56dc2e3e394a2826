"""Draft models for STANDALONE speculative decoding, built from a target checkpoint: its first
layers (the embeddings, final norm and lm_head stay), so the draft shares the target's tokenizer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file


def first_layers_draft(target: Path, layers: int, out: Path) -> Path:
    """out: a checkpoint of target's first `layers` decoder layers (rebuilt when missing)."""
    if (out / "model.safetensors").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    for f in target.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "SHA256SUMS":
            shutil.copy(f, out / f.name)
    config = json.loads((target / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {}
    for f in sorted(target.glob("*.safetensors")):
        for name, t in load_file(f).items():
            if not name.startswith("model.layers.") or int(name.split(".")[2]) < layers:
                tensors[name] = t
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out
