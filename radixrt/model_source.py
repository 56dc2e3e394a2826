"""Where the checkpoint comes from: a local directory, or a Hugging Face repo id.

As in SGLang, `--model-path` (and `--tokenizer-path`) names either an existing
directory, used as it is, or a repo id at `--revision` (a branch, tag or
commit; default main). A repo id is looked up in the local Hugging Face cache
first (HF_HUB_CACHE / HF_HOME) and downloaded into it only when that fails and
downloads are allowed (HF_HUB_OFFLINE unset). `resolve_model_source` does this
once, before any process starts: the processes get local directories, while
what users see (the /get_model_info model_path, the OpenAI model name) stays
what they typed, because the entry points keep the typed ServerArgs for that.

A cached snapshot must be whole: a model's holds config.json and safetensors
weights (a cache that only ever served AutoConfig has config.json alone), a
tokenizer's its tokenizer files; a partial one is completed by a download or
refused, naming what it lacks. A local directory needs only config.json here;
the worker's loader names what else is missing. Either way, every file a load may read
(MODEL_FILES' patterns) must be a regular file: a FIFO there would block its reader forever
(checkpoint_meta.irregular_files), so it is refused before any process reads it.

A GGUF file (SGLang's check: named *.gguf or starting with b"GGUF"), under load_format auto or
gguf, is served through its sidecar directory (utils/gguf_sidecar.py: config.json and the
tokenizer read from the file, built once per file and cached), and the processes run with
load_format and quantization gguf, as SGLang sets them. load_format gguf or quantization gguf
without a GGUF file, or a GGUF file under load_format safetensors, is refused naming both; so is
a weight update from disk to or from a GGUF model (its tensors have no safetensors headers to
compare: a GGUF model is served from the start only).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from radixrt.config import ServerArgs
from radixrt.errors import RequestError
from radixrt.utils.checkpoint_meta import MAX_PATH_CHARS, irregular_files
from radixrt.utils.gguf_sidecar import ensure_sidecar, gguf_source, is_gguf_file

logger = logging.getLogger(__name__)

# What a download fetches: config and generation config, weights, tokenizer files, chat templates.
MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
TOKENIZER_FILES = ["*.json", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
# Other layouts of the same weights some repos also carry (Meta's original/, Mistral's consolidated).
SKIPPED_FILES = ["original/*", "consolidated*.safetensors"]
TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass(frozen=True)
class Hub:
    """Where repo ids are looked up: the cache directory, and whether a miss may download."""

    cache_dir: Path
    offline: bool

    @classmethod
    def from_env(cls) -> Hub:
        from huggingface_hub import constants

        return cls(Path(constants.HF_HUB_CACHE), bool(constants.HF_HUB_OFFLINE))


def resolve_model_source(args: ServerArgs, hub: Hub | None = None) -> ServerArgs:
    """The ServerArgs the processes run with: model_path and tokenizer_path as local
    directories, served_model_name fixed to the name the user gave. Starts nothing;
    raises ValueError naming the argument, the repo id, the revision and the cache."""
    hub = hub or Hub.from_env()
    gguf = serves_gguf(args)
    if gguf:
        model = gguf_dir(args.model_path, "model_path")
    else:
        model = local_dir(args.model_path, args.revision, "model_path", checkpoint_gap, MODEL_FILES, hub)
    tokenizer = None
    if args.tokenizer_path is not None and is_gguf_file(args.tokenizer_path):
        tokenizer = gguf_dir(args.tokenizer_path, "tokenizer_path")
    elif args.tokenizer_path is not None:
        tokenizer = local_dir(args.tokenizer_path, args.revision, "tokenizer_path", tokenizer_gap, TOKENIZER_FILES, hub)
    formats = {"load_format": "gguf", "quantization": "gguf"} if gguf else {}
    return dataclasses.replace(
        args, model_path=str(model), tokenizer_path=None if tokenizer is None else str(tokenizer),
        served_model_name=args.model_name, **formats,
    )


def serves_gguf(args: ServerArgs) -> bool:
    """Whether model_path is served as a GGUF file; ValueError when the flags and the file disagree."""
    is_gguf = is_gguf_file(args.model_path)
    name = args.model_path
    if is_gguf and args.load_format == "safetensors":
        raise ValueError(f"model_path {name!r} is a GGUF file, and load_format safetensors reads safetensors "
                         "checkpoints: use load_format auto or gguf")
    if not is_gguf and args.load_format == "gguf":
        raise ValueError(f"load_format gguf reads a GGUF file (named *.gguf, or starting with b'GGUF'); "
                         f"model_path {name!r} is not one")
    if not is_gguf and args.quantization == "gguf":
        raise ValueError(f"quantization gguf serves a GGUF file (named *.gguf, or starting with b'GGUF'); "
                         f"model_path {name!r} is not one")
    return is_gguf


def gguf_dir(name: str, what: str) -> Path:
    """The sidecar directory of the GGUF file `name` (built on first use); ValueError naming it."""
    try:
        return ensure_sidecar(name)
    except OSError as e:  # the file, or the sidecar cache, cannot be read or written
        raise ValueError(f"{what} {name!r}: its GGUF sidecar cannot be built: {e.strerror or e}") from None


def resolve_update_path(args: ServerArgs, model_path: str) -> str:
    """The local checkpoint directory of a weight update's model_path (a directory, or a Hugging
    Face repo id through the cache, at args.revision, as at start). Raises RequestError naming it,
    and for a GGUF file, or a server serving one (args typed or resolved)."""
    serving_gguf = args.load_format == "gguf" or is_gguf_file(args.model_path) or gguf_source(args.model_path)
    if serving_gguf or is_gguf_file(model_path):
        which = f"this server serves the GGUF file {args.model_path}" if serving_gguf else f"{model_path} is a GGUF file"
        raise RequestError(f"weight updates from disk read safetensors checkpoints, and {which}: a GGUF model "
                           "is served from the start only", "model_path")
    try:
        return resolve_model_source(dataclasses.replace(args, model_path=model_path, tokenizer_path=None)).model_path
    except ValueError as e:
        raise RequestError(str(e), "model_path") from None


def local_dir(name: str, revision: str | None, what: str, gap: Callable[[Path], str | None],
              patterns: list[str], hub: Hub) -> Path:
    """A local directory for `name`: the directory itself, or the repo's cached (or downloaded) snapshot,
    holding only regular files where a load reads."""
    if len(name) > MAX_PATH_CHARS:
        raise ValueError(f"{what} is {len(name)} characters long; the limit is {MAX_PATH_CHARS} (PATH_MAX)")
    try:
        found = _local(Path(name).expanduser(), name, revision, what)
        if found is None and not _is_repo_id(name):
            raise ValueError(f"{what} {name!r} is not a local directory (nor a Hugging Face repo id)")
        found = found or _snapshot(name, revision, what, gap, patterns, hub)
        irregular = irregular_files(found, patterns)
    except OSError as e:  # a component longer than NAME_MAX (ENAMETOOLONG), no permission, ...
        raise ValueError(f"{what} {name!r} cannot be read: {e.strerror or e}") from None
    if irregular:
        raise ValueError(f"{what} {name!r} holds {', '.join(irregular)}, not regular files "
                         "(a FIFO, socket, device or directory): refused before anything reads them")
    return found


def _local(path: Path, name: str, revision: str | None, what: str) -> Path | None:
    """path resolved if it is a directory (a model's must hold config.json), else None."""
    if not path.is_dir():
        return None
    if what == "model_path" and not (path / "config.json").is_file():
        raise ValueError(f"{what} {name!r} has no config.json (not a Hugging Face checkpoint directory)")
    if revision is not None:
        logger.warning("%s %s is a local directory: --revision %s does not apply to it", what, name, revision)
    return path.resolve()


def checkpoint_gap(snapshot: Path) -> str | None:
    """What a cached model snapshot lacks to be served, or None."""
    if not (snapshot / "config.json").is_file():
        return "has no config.json"
    if not any(snapshot.glob("*.safetensors")):
        return "has no *.safetensors weights"
    return None


def tokenizer_gap(snapshot: Path) -> str | None:
    """What a cached tokenizer snapshot lacks, or None."""
    if not any((snapshot / f).is_file() for f in TOKENIZER_MARKERS):
        return f"has none of {', '.join(TOKENIZER_MARKERS)}"
    return None


def _is_repo_id(name: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _snapshot(repo: str, revision: str | None, what: str, gap: Callable[[Path], str | None],
              patterns: list[str], hub: Hub) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    where = f"{what} {repo!r} is not a local directory; as a Hugging Face repo id at revision {revision or 'main'}"
    try:
        cached = Path(snapshot_download(repo, revision=revision, cache_dir=hub.cache_dir, local_files_only=True))
        missing = gap(cached)
    except LocalEntryNotFoundError:
        cached, missing = None, None
    if cached is not None and missing is None:
        return cached
    found = f"its cached snapshot {cached} {missing}" if cached is not None else f"it is not in the cache {hub.cache_dir}"
    if hub.offline:
        raise ValueError(f"{where}, {found}, and downloads are off (HF_HUB_OFFLINE is set)")
    logger.info("downloading %s (revision %s) into %s", repo, revision or "main", hub.cache_dir)
    try:
        downloaded = Path(snapshot_download(repo, revision=revision, cache_dir=hub.cache_dir,
                                            allow_patterns=patterns, ignore_patterns=SKIPPED_FILES))
    except Exception as e:  # noqa: BLE001 - network, auth, unknown repo or revision: all end the start, named
        reason = " ".join(str(e).split())  # the Hub's messages span lines; the start error is one
        raise ValueError(f"{where}, {found}, and downloading it failed: {type(e).__name__}: {reason}") from None
    missing = gap(downloaded)
    if missing is not None:
        raise ValueError(f"{where}, the downloaded snapshot {downloaded} {missing}")
    return downloaded
