"""The model's own sampling defaults, from its generation_config.json (`--sampling-defaults`).

SGLang 0.5.9 (`ModelConfig.get_default_sampling_params`, default "model") takes
five keys from generation_config.json: temperature, top_p, top_k, min_p and
repetition_penalty, each only when the file sets it (not null); every other key
(do_sample, max_new_tokens, ...) is ignored, and "openai" ignores the file.
It fills them into /v1/chat/completions requests that leave them unset
(`ChatCompletionRequest.to_sampling_params`); /v1/completions and /generate
keep their fixed defaults. radixrt does the same: the tokenizer manager loads
the defaults once at start, the chat route applies them with `with_defaults`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

from radixrt.errors import RequestError
from radixrt.sampling_params import SamplingParams, SamplingParamsIn
from radixrt.settings.chat import SAMPLING_DEFAULTS

SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
GENERATION_CONFIG = "generation_config.json"


def model_sampling_defaults(model_dir: Path, mode: str) -> dict[str, Any]:
    """The sampling values the model's generation_config.json sets ({} for "openai", or without
    the file). Raises ValueError naming the file and the key when a value is not a valid one."""
    if mode not in SAMPLING_DEFAULTS:
        raise ValueError(f"sampling_defaults must be one of {', '.join(SAMPLING_DEFAULTS)}, got {mode!r}")
    path = Path(model_dir) / GENERATION_CONFIG
    if mode == "openai" or not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    defaults = {k: config[k] for k in SAMPLING_DEFAULT_KEYS if config.get(k) is not None}
    try:  # the same checks a request's values get, once, so no request fails for the model's values
        SamplingParams.from_input(msgspec.convert(defaults, SamplingParamsIn))
    except (msgspec.ValidationError, RequestError) as e:
        raise ValueError(f"{path} has a sampling default this server refuses: {e}") from None
    return defaults


def with_defaults(params: SamplingParamsIn, defaults: dict[str, Any]) -> SamplingParamsIn:
    """params with each default filled in where the request left the field unset."""
    unset = {k: v for k, v in defaults.items() if getattr(params, k) in (None, msgspec.UNSET)}
    return msgspec.structs.replace(params, **unset) if unset else params
