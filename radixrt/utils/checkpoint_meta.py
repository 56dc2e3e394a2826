"""What a checkpoint's files say without loading a weight: the safetensors headers
(each tensor's name, dtype and shape) and the config.json fields that fix the
architecture. `radixrt estimate` counts parameters from them, and a weight
update compares two checkpoints with them before anything is read.

A safetensors file starts with an 8-byte little-endian header length and a
JSON header {name: {"dtype", "shape", "data_offsets"}, "__metadata__": ...};
only that header is read here.

Only regular files are read, and their sizes are checked first: a FIFO (which blocks its
reader until someone writes) or a device in a checkpoint directory, a header longer than its
file, or an oversized JSON file is refused with a ValueError naming the file, before a read
could hang the server's thread or exhaust its memory.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterable

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
MAX_JSON_BYTES = 100 << 20  # config.json, the shard index: far below this in any real checkpoint
MAX_PATH_CHARS = 4096  # Linux's PATH_MAX: a longer path names no file


@dataclass(frozen=True)
class TensorMeta:
    dtype: str  # safetensors' name: F32, BF16, ...
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def open_regular(file: Path) -> BinaryIO:
    """file, open for reading, if it is a regular file; else ValueError naming it. Opened without
    blocking (a FIFO's open would wait for a writer) and checked on the open descriptor."""
    fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{file} is not a regular file (a FIFO, socket, device or directory): not read")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def irregular_files(path: Path, patterns: Iterable[str]) -> list[str]:
    """Names of path's entries matching patterns (the files a load reads) that are not regular files
    (is_file follows links, as the Hugging Face cache's snapshots are links to blobs)."""
    return sorted({f.name for pattern in patterns for f in path.glob(pattern) if not f.is_file()})


def read_json(file: Path, limit: int = MAX_JSON_BYTES) -> object:
    """A JSON file's value: a regular file of at most limit bytes (ValueError naming it otherwise)."""
    with open_regular(file) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise ValueError(f"{file} is {size} bytes; a checkpoint's JSON file is at most {limit}")
        try:
            return json.loads(f.read())
        except (ValueError, RecursionError) as e:
            raise ValueError(f"{file} is not valid JSON: {e}") from None


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's weight files: the shards its index lists, else every *.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        index_json = read_json(index)
        weight_map = index_json.get("weight_map") if isinstance(index_json, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ValueError(f"{index} has no weight_map of tensor names to file names")
        return [path / f for f in sorted(set(weight_map.values()))]
    return sorted(path.glob("*.safetensors"))


def read_header(file: Path) -> dict[str, TensorMeta]:
    """One safetensors file's tensors by name. Raises ValueError for a file that is not one
    (not a regular file, a header length past its end, a header not of tensors)."""
    with open_regular(file) as f:
        size = os.fstat(f.fileno()).st_size
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{file} is not a safetensors file (shorter than its header length)")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise ValueError(f"{file} is not a safetensors file (header length {n}, file size {size})")
        try:
            header = json.loads(f.read(n))
            return {name: TensorMeta(str(t["dtype"]), tuple(int(d) for d in t["shape"]))
                    for name, t in header.items() if name != "__metadata__"}
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as e:
            raise ValueError(f"{file} has an unreadable safetensors header: {type(e).__name__}: {e}") from None


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
    value = read_json(cfg)
    if not isinstance(value, dict):
        raise ValueError(f"{cfg} is not a JSON object")
    return value


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
