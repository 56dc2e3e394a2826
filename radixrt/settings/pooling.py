"""How the served model turns a text into an embedding: its pooling (the last token's final
hidden state, the mean over the tokens, or the first token's) and whether the vector is
L2-normalized, and which Matryoshka dimensions it may be cut to.

Read from the checkpoint as sentence-transformers writes it (modules.json: a Pooling module whose
config.json names the mode, and a Normalize module when the vectors are normalized); without
one, SGLang's and vLLM's default for a decoder model: the last token, normalized. vLLM's
--pooler-config ({"pooling_type": "LAST" | "MEAN" | "CLS", "normalize": bool}) overrides either
part. A checkpoint whose pipeline does something radixrt does not (max pooling, a Dense layer)
is refused at start, naming it, rather than served wrong. Torch-free: the frontend reads it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from radixrt.settings.fields import arg

POOLING_TYPES = {"LAST": "last", "MEAN": "mean", "CLS": "cls"}  # vLLM's names -> messages.Readout kinds
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
_ST_OTHER_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
_ST_MODULES_DONE_HERE = ("Transformer", "Pooling", "Normalize")  # the others change the vector: refused


@dataclass(frozen=True)
class Pooler:
    kind: str = "last"  # "last" | "mean" | "cls"
    normalize: bool = True
    matryoshka_dimensions: tuple[int, ...] | None = None  # config.json's; None: any, if is_matryoshka
    is_matryoshka: bool = False  # `dimensions` may cut the vector (SGLang's check)
    source: str = "default"  # where the pooling came from, for /get_server_info and errors
    hidden_size: int = 0  # the vectors' length (0: unknown, a GGUF checkpoint)
    head_labels: int = 0  # a …ForSequenceClassification checkpoint's outputs (its cross-encoder head); 0: none

    def check_dimensions(self, dimensions: int | None) -> None:
        """SGLang's rules for `dimensions`; ValueError naming what is wrong."""
        if dimensions is None:
            return
        if not self.is_matryoshka:
            raise ValueError("this model does not support Matryoshka representations (its config.json has neither "
                             "matryoshka_dimensions nor is_matryoshka): `dimensions` would cut it into poor embeddings")
        if dimensions < 1 or (self.hidden_size and dimensions > self.hidden_size):
            raise ValueError(f"dimensions must be in [1, {self.hidden_size}], got {dimensions}")
        if self.matryoshka_dimensions and dimensions not in self.matryoshka_dimensions:
            raise ValueError(f"this model supports only the Matryoshka dimensions {list(self.matryoshka_dimensions)}, "
                             f"got {dimensions}")


def load_pooler(model_path: str, pooler_config: str | None) -> Pooler:
    """The served model's pooling: its checkpoint's, with --pooler-config's fields over it.
    ValueError for a pipeline or a flag radixrt cannot serve as written."""
    root = Path(model_path)
    root = root if root.is_dir() else root.parent  # a GGUF file: its directory
    kind, normalize, source = "last", True, "default (last token, normalized)"
    if (root / "modules.json").is_file():
        kind, normalize = _sentence_transformers(root)
        source = f"{root / 'modules.json'}"
    if pooler_config:
        kind, normalize = _override(pooler_config, kind, normalize)
        source = "--pooler-config"
    cfg = _json(root / "config.json") if (root / "config.json").is_file() else {}
    dims = cfg.get("matryoshka_dimensions")
    return Pooler(kind, normalize, tuple(dims) if dims else None, bool(dims or cfg.get("is_matryoshka")), source,
                  int(cfg.get("hidden_size") or 0), classifier_labels(cfg))


def classifier_labels(config: dict[str, Any]) -> int:
    """A …ForSequenceClassification checkpoint's head outputs (transformers' num_labels: id2label's
    length, 2 by default); 0 for any other checkpoint."""
    if not any(str(a).endswith("ForSequenceClassification") for a in config.get("architectures") or []):
        return 0
    return int(config.get("num_labels") or len(config.get("id2label") or {}) or 2)


def _sentence_transformers(root: Path) -> tuple[str, bool]:
    kind, normalize = "last", False
    for module in _json(root / "modules.json"):
        name = str(module.get("type", "")).rsplit(".", 1)[-1]
        if name not in _ST_MODULES_DONE_HERE:
            raise ValueError(f"{root / 'modules.json'}: the sentence-transformers module {module.get('type')!r} is not "
                             "supported (radixrt pools and normalizes; it does not run other modules)")
        if name == "Normalize":
            normalize = True
        elif name == "Pooling":
            kind = _pooling_mode(root / module.get("path", "") / "config.json")
    return kind, normalize


def _pooling_mode(path: Path) -> str:
    cfg = _json(path)
    other = [m for m in _ST_OTHER_MODES if cfg.get(m)]
    modes = [kind for key, kind in _ST_MODES.items() if cfg.get(key)]
    if other or len(modes) != 1:
        raise ValueError(f"{path}: radixrt pools by exactly one of {', '.join(_ST_MODES)}; this config sets "
                         f"{', '.join(other + [k for k in _ST_MODES if cfg.get(k)]) or 'none'}")
    if cfg.get("include_prompt") is False:
        raise ValueError(f"{path}: include_prompt false (pooling without the instruction's tokens) is not supported")
    return modes[0]


def _override(text: str, kind: str, normalize: bool) -> tuple[str, bool]:
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--pooler-config is not JSON: {e}") from None
    if not isinstance(cfg, dict) or set(cfg) - {"pooling_type", "normalize"}:
        raise ValueError("--pooler-config takes a JSON object with pooling_type (LAST, MEAN or CLS) and normalize")
    if "pooling_type" in cfg:
        name = str(cfg["pooling_type"]).upper()
        if name not in POOLING_TYPES:
            raise ValueError(f"--pooler-config pooling_type must be one of {', '.join(POOLING_TYPES)}, got {name!r}")
        kind = POOLING_TYPES[name]
    if "normalize" in cfg:
        if not isinstance(cfg["normalize"], bool):
            raise ValueError("--pooler-config normalize must be true or false")
        normalize = cfg["normalize"]
    return kind, normalize


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None


@dataclass(frozen=True)
class PoolingArgs:
    is_embedding: bool = arg(
        False, "serve embeddings only (SGLang's): /encode, /v1/embeddings and a cross-encoder's /v1/rerank answer, the "
        "generating routes refuse; without it the server generates and serves embeddings, scores and reranking too"
    )
    pooler_config: str | None = arg(
        None, "vLLM's pooler override, JSON: {\"pooling_type\": \"LAST\" | \"MEAN\" | \"CLS\", \"normalize\": bool}; "
        "default: the checkpoint's sentence-transformers modules, else the last token, normalized"
    )

    def check(self) -> None:
        """ValueError when --pooler-config cannot be read."""
        if self.pooler_config is not None:
            _override(self.pooler_config, "last", True)
