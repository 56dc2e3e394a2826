"""A GGUF file as the checkpoint directory every process reads: its "sidecar".

SGLang serves `--model-path model.gguf` (a file named *.gguf or starting with the magic b"GGUF";
`--load-format auto` or `gguf`). radixrt's processes read config.json and the tokenizer from
model_path as a directory, so `resolve_model_source` (model_source.py) turns the file, once,
before any process starts, into a small directory of its own:

  * config.json: transformers' reading of the file's metadata (AutoConfig with gguf_file), plus
    `architectures` (as SGLang adds it) and `dtype: float32`. GGUF weights are dequantized to
    float32 (transformers does so too, and loads them in float32 by default); SGLang's GGUF
    config has no dtype, which its `--dtype auto` reads as float32, so it serves float16 on CUDA
    (bfloat16 for Gemma): models/dtype.resolve_dtype gives the same answer here, float32 on CPU;
  * the tokenizer files, chat template included, as AutoTokenizer reads them from the file;
  * MARKER (gguf_source.json): the absolute path of the .gguf file, its architecture, size and
    mtime. The weights stay in the file: models/gguf_checkpoint.py reads them from there at load.

Sidecars live under RADIXRT_GGUF_CACHE (default $XDG_CACHE_HOME/radixrt/gguf, else
~/.cache/radixrt/gguf), one per file path, size and mtime (so an edited file gets a new one),
and this module's and transformers' versions (a new reading gets a new one). Each is built in a
temporary directory and renamed into place: concurrent starts on one file both succeed, and a
start that dies midway leaves no half-built sidecar behind.

Only the architectures radixrt serves are read (GGUF_FAMILIES); any other general.architecture
is refused by name before anything is built.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

MARKER = "gguf_source.json"
GGUF_MAGIC = b"GGUF"
SIDECAR_FORMAT = 1  # bump when what a sidecar holds changes: every file then gets a new one
# GGUF general.architecture -> the model_type radixrt serves it as (models/registry.MODEL_FAMILIES).
# llama.cpp writes Mistral as llama; Mixtral too, with experts, which transformers cannot read (refused).
GGUF_FAMILIES = {
    "llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe", "phi3": "phi3",
    "gemma2": "gemma2", "gemma3": "gemma3_text",
}


@dataclass(frozen=True)
class GgufSource:
    """The GGUF file a sidecar stands for, as it was when the sidecar was built."""

    path: str  # absolute
    architecture: str  # general.architecture
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, file: Path, architecture: str) -> GgufSource:
        st = file.stat()
        return cls(str(file.resolve()), architecture, st.st_size, st.st_mtime_ns)

    def check_unchanged(self) -> None:
        """Raise ValueError when the file is gone or was rewritten since the sidecar was built."""
        try:
            now = GgufSource.of(Path(self.path), self.architecture)
        except OSError as e:
            raise ValueError(f"GGUF file {self.path} cannot be read: {e.strerror or e}") from None
        if (now.size, now.mtime_ns) != (self.size, self.mtime_ns):
            raise ValueError(f"GGUF file {self.path} changed after its config and tokenizer were read: "
                             "start the server again to read it anew")


def is_gguf_file(path: str | Path) -> bool:
    """Whether path names a GGUF file (SGLang's check_gguf_file): a regular file named *.gguf or
    starting with b"GGUF". A directory, a FIFO or an unreadable file is not one."""
    path = Path(path).expanduser()
    try:
        if not path.is_file():
            return False
        if path.suffix == ".gguf":
            return True
        with open(path, "rb") as f:
            return f.read(len(GGUF_MAGIC)) == GGUF_MAGIC
    except OSError:
        return False


def gguf_source(model_dir: str | Path) -> GgufSource | None:
    """The GGUF file a sidecar directory stands for; None for any other directory."""
    marker = Path(model_dir) / MARKER
    if not marker.is_file():
        return None
    return GgufSource(**json.loads(marker.read_text()))


def sidecar_root() -> Path:
    if os.environ.get("RADIXRT_GGUF_CACHE"):
        return Path(os.environ["RADIXRT_GGUF_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "radixrt" / "gguf"


def sidecar_dir(file: Path) -> Path:
    """Where the sidecar of file (as it is now) lives: keyed by its path, size and mtime."""
    st = file.stat()
    key = f"{file.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0{SIDECAR_FORMAT}\0{version('transformers')}"
    return sidecar_root() / f"{file.stem[:64]}-{hashlib.sha256(key.encode()).hexdigest()[:20]}"


def ensure_sidecar(file: str | Path) -> Path:
    """The sidecar directory of a GGUF file, built on first use. Raises ValueError naming the
    file for an architecture radixrt does not serve, or a file transformers cannot read."""
    file = Path(file).expanduser()
    final = sidecar_dir(file)
    if (final / MARKER).is_file():
        return final
    architecture = gguf_architecture(file)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        _write_sidecar(file, architecture, tmp)
        os.rename(tmp, final)
    except OSError:
        if not (final / MARKER).is_file():  # not a concurrent start that finished first
            raise
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - transformers failing on this file ends the start, named
        raise ValueError(f"transformers cannot read GGUF file {str(file)!r}: {type(e).__name__}: {e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def gguf_architecture(file: Path) -> str:
    """The file's general.architecture, if radixrt serves it; else ValueError naming it."""
    from transformers.integrations.gguf import read_gguf_metadata

    try:
        metadata, _ = read_gguf_metadata(str(file))
    except (ValueError, KeyError, OSError) as e:
        raise ValueError(f"model_path {str(file)!r} is not a readable GGUF file: {e}") from None
    arch = metadata["general.architecture"]
    if arch not in GGUF_FAMILIES:
        raise ValueError(f"GGUF file {str(file)!r} holds a {arch!r} model (general.architecture); radixrt serves "
                         f"GGUF architectures {', '.join(GGUF_FAMILIES)}")
    if arch == "llama" and metadata.get("llama.expert_count", 0):
        raise ValueError(f"GGUF file {str(file)!r} is a llama with {metadata['llama.expert_count']} experts "
                         "(Mixtral): transformers reads it as a dense llama, so radixrt does not serve it from GGUF; "
                         "serve its safetensors checkpoint")
    return arch


def _write_sidecar(file: Path, architecture: str, out: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    folder, name = str(file.resolve().parent), file.resolve().name
    config = AutoConfig.from_pretrained(folder, gguf_file=name).to_dict()
    (out / "config.json").write_text(json.dumps(_served_config(config, architecture), indent=2) + "\n")
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
    (out / MARKER).write_text(json.dumps(asdict(GgufSource.of(file, architecture)), indent=2) + "\n")


def _served_config(config: dict[str, Any], architecture: str) -> dict[str, Any]:
    """config.json for transformers' config of the file: the class that runs it named, float32."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = config.get("model_type")
    served = {GGUF_FAMILIES[architecture]} | ({"mistral"} if architecture == "llama" else set())
    if model_type not in served:  # transformers reads a llama file named mistral as mistral
        raise ValueError(f"transformers reads this {architecture!r} GGUF file as model_type {model_type!r}, "
                         "which radixrt does not serve")
    config.pop("_model_name_or_path", None)  # general.name: a label, not a path
    return {**config, "architectures": [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]], "dtype": "float32"}
