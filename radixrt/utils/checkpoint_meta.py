"""What a checkpoint's files say without loading a weight: the safetensors headers
(each tensor's name, dtype and shape) and the config.json fields that fix the
architecture. `radixrt estimate` counts parameters from them, and a weight
update compares two checkpoints with them before anything is read.

A safetensors file starts with an 8-byte little-endian header length and a
JSON header {name: {"dtype", "shape", "data_offsets"}, "__metadata__": ...};
only that header is read here.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

# safetensors dtype names -> bytes per element
SAFETENSORS_ITEMSIZE = {
    "F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
    "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1,
}
# config.json keys whose values must agree for new weights to fit the running model
ARCHITECTURE_KEYS = (
    "model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings", "num_local_experts",
    "num_experts", "num_experts_per_tok", "moe_intermediate_size", "attention_bias", "mlp_bias",
)
MAX_HEADER_BYTES = 100 << 20  # a header larger than this is not a safetensors file


@dataclass(frozen=True)
class TensorMeta:
    dtype: str  # safetensors' name: F32, BF16, ...
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's weight files: the shards its index lists, else every *.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        return [path / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return sorted(path.glob("*.safetensors"))


def read_header(file: Path) -> dict[str, TensorMeta]:
    """One safetensors file's tensors by name. Raises ValueError for a file that is not one."""
    with file.open("rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{file} is not a safetensors file (shorter than its header length)")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER_BYTES:
            raise ValueError(f"{file} is not a safetensors file (header length {n})")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise ValueError(f"{file} has an unreadable safetensors header: {e}") from None
    return {name: TensorMeta(t["dtype"], tuple(t["shape"])) for name, t in header.items() if name != "__metadata__"}


def checkpoint_tensors(path: str | Path) -> dict[str, TensorMeta]:
    """Every tensor of the checkpoint at path, by name. Raises ValueError when it has none."""
    path = Path(path)
    files = safetensors_files(path)
    if not files:
        raise ValueError(f"{path} has no *.safetensors files")
    out: dict[str, TensorMeta] = {}
    for file in files:
        out.update(read_header(file))
    return out


def read_config(path: str | Path) -> dict:
    """config.json of the checkpoint at path. Raises ValueError when there is none."""
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        raise ValueError(f"{path} has no config.json: not a Hugging Face checkpoint directory")
    return json.loads(cfg.read_text())


def incompatibility(current: str | Path, new: str | Path) -> str | None:
    """Why the weights at `new` cannot replace those at `current` in a running model (another
    architecture, a different tensor set or shape), or None when they fit. Reads headers only;
    a dtype change is allowed (the loader converts to the running dtype)."""
    try:
        old_cfg, new_cfg = read_config(current), read_config(new)
        old_t, new_t = checkpoint_tensors(current), checkpoint_tensors(new)
    except (ValueError, OSError) as e:
        return str(e)
    for key in ARCHITECTURE_KEYS:
        if old_cfg.get(key) != new_cfg.get(key):
            return f"config.json {key} differs: {old_cfg.get(key)!r} now, {new_cfg.get(key)!r} in {new}"
    missing, extra = sorted(old_t.keys() - new_t.keys()), sorted(new_t.keys() - old_t.keys())
    if missing or extra:
        return f"the tensor names differ: {new} lacks {missing[:3]} and adds {extra[:3]}"
    for name, meta in old_t.items():
        if new_t[name].shape != meta.shape:
            return f"tensor {name} has shape {list(new_t[name].shape)} in {new}, {list(meta.shape)} now"
    return None
