"""Sampling parameters: SGLang's field names, validated once at the door.

`SamplingParams.from_dict` is the only way user input becomes parameters; it
raises `ValueError` naming the offending field, so every front door (Engine,
HTTP) reports bad input the same way. The struct then crosses process
boundaries unchanged (it is a msgspec Struct).
"""

from __future__ import annotations

from typing import Any

import msgspec

# Fields SGLang accepts that we cannot honour yet: asking for them is an error,
# never a silently unconstrained answer.
UNSUPPORTED_FIELDS = ("regex", "json_schema", "ebnf", "stop_regex", "structural_tag")
# Accepted spellings of the same field (vLLM / OpenAI vs SGLang).
ALIASES = {"sampling_seed": "seed", "max_tokens": "max_new_tokens"}
# Below this temperature sampling is greedy (as SGLang does).
GREEDY_TEMPERATURE = 1e-5


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    seed: int | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        """Validate user input; None and missing fields take defaults."""
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise ValueError(f"sampling_params must be an object, got {type(d).__name__}")
        fields: dict[str, Any] = {}
        for key, value in d.items():
            if value is None:
                continue
            if key in UNSUPPORTED_FIELDS:
                if not value:  # an empty constraint (SGLang's client sends stop_regex=[]) asks for nothing
                    continue
                raise ValueError(f"sampling_params.{key} (constrained decoding) is not supported by this server yet")
            fields[ALIASES.get(key, key)] = value
        if isinstance(fields.get("stop"), str):
            fields["stop"] = [fields["stop"]]
        if isinstance(fields.get("stop"), tuple):
            fields["stop"] = list(fields["stop"])
        if fields.get("top_k") == 0:
            fields["top_k"] = -1
        try:
            params = msgspec.convert(fields, cls, strict=False)
        except msgspec.ValidationError as e:
            raise ValueError(f"sampling_params: {_field_message(e)}") from None
        params.check()
        return params

    def check(self) -> None:
        """Range checks; raise ValueError naming the field."""
        _require(self.max_new_tokens >= 0, "max_new_tokens", "must be >= 0", self.max_new_tokens)
        _require(self.min_new_tokens >= 0, "min_new_tokens", "must be >= 0", self.min_new_tokens)
        _require(
            self.min_new_tokens <= self.max_new_tokens, "min_new_tokens", "must be <= max_new_tokens", self.min_new_tokens
        )
        _require(self.temperature >= 0, "temperature", "must be >= 0", self.temperature)
        _require(0 < self.top_p <= 1, "top_p", "must be in (0, 1]", self.top_p)
        _require(self.top_k == -1 or self.top_k >= 1, "top_k", "must be -1 (off) or >= 1", self.top_k)
        _require(0 <= self.min_p <= 1, "min_p", "must be in [0, 1]", self.min_p)
        _require(-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]", self.frequency_penalty)
        _require(-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]", self.presence_penalty)
        _require(0 < self.repetition_penalty <= 2, "repetition_penalty", "must be in (0, 2]", self.repetition_penalty)
        _require(self.n >= 1, "n", "must be >= 1", self.n)
        _require(all(s for s in self.stop), "stop", "must not contain empty strings", self.stop)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.frequency_penalty != 0 or self.presence_penalty != 0 or self.repetition_penalty != 1


def _require(ok: bool, field: str, rule: str, value: Any) -> None:
    if not ok:
        raise ValueError(f"sampling_params.{field} {rule}, got {value!r}")


def _field_message(e: msgspec.ValidationError) -> str:
    # msgspec says e.g. "Expected `float`, got `str` - at `$.temperature`";
    # put the field name first so the message names it plainly.
    msg = str(e)
    if " - at `$." in msg:
        text, path = msg.rsplit(" - at `$.", 1)
        return f"{path.rstrip('`')}: {text}"
    return msg
