"""The weights the frontend serves (path, fingerprint, version: what /get_model_info and every
result's meta_info report) and the options of a weight update, checked as SGLang 0.5.9's
UpdateWeightFromDiskReqInput defines them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from radixrt.config import ServerArgs
from radixrt.errors import RequestError

DEFAULT_WEIGHT_VERSION = "default"  # SGLang's --weight-version default
LOAD_FORMATS = (None, "auto", "safetensors")  # an update reads safetensors checkpoints only (GGUF: at start)
# SGLang fields a radixrt update cannot honour, with the one value it can (any other is a 400 naming the field)
UNSUPPORTED_UPDATE_OPTIONS: dict[str, Any] = {
    "is_async": False,  # the call returns when the new weights serve
    "keep_pause": False,  # radixrt has no pause: held requests always resume after the update
    "flush_cache": True,  # KV computed with the old weights is garbage under the new ones: always dropped
    "manifest": None,
}
# SGLang fields that change nothing here: torch_empty_cache and token_step do nothing in SGLang 0.5.9's
# disk update either, and CUDA graphs are recaptured whenever the update needs it (fp8 scales refit).
IGNORED_UPDATE_OPTIONS = ("torch_empty_cache", "recapture_cuda_graph", "token_step")


@dataclass(frozen=True)
class ServedWeights:
    model_path: str  # as the user named it (a directory or a Hugging Face repo id)
    local_path: str  # the checkpoint directory the workers read
    fingerprint: str  # worker/kv_tiers.weights_fingerprint of what the workers hold
    version: str  # SGLang's weight_version label


class UpdateWeightsResult(NamedTuple):
    """SGLang's (success, message, num_paused_requests): unpacks as SGLang's Engine returns it."""

    success: bool
    message: str
    num_paused_requests: int = 0


def model_info(args: ServerArgs, weights: ServedWeights) -> dict[str, Any]:
    """SGLang's /get_model_info body, for the weights now served."""
    return {
        "model_path": weights.model_path,
        "tokenizer_path": args.tokenizer_path or args.model_path,
        "served_model_name": args.model_name,
        "is_generation": True,
        "weight_version": weights.version,
        "weights_fingerprint": weights.fingerprint,
    }


def check_update_options(load_format: str | None = None, **options: Any) -> None:
    """Raise RequestError naming the first option this server cannot honour."""
    if load_format not in LOAD_FORMATS:
        raise RequestError(f"load_format {load_format!r} is not supported; a weight update loads safetensors "
                           f"checkpoints ({', '.join(str(f) for f in LOAD_FORMATS)}; a GGUF model is served from "
                           "the start only)", "load_format")
    for name, value in options.items():
        if name in UNSUPPORTED_UPDATE_OPTIONS and value != UNSUPPORTED_UPDATE_OPTIONS[name]:
            raise RequestError(f"{name}={value!r} is not supported by radixrt's weight update "
                               f"(only {UNSUPPORTED_UPDATE_OPTIONS[name]!r})", name)
        if name not in UNSUPPORTED_UPDATE_OPTIONS and name not in IGNORED_UPDATE_OPTIONS:
            raise RequestError(f"unknown weight update option {name!r}", name)
